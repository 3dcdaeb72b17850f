"""Tokenizers round-trip, and incremental detokenization never emits half a character."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxfill.engine.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from jaxfill.models import ModelConfig

TEXT = "héllo wörld — 日本語 and emoji 🦙🚀 done"


def stream(tokenizer, ids):
    detok = tokenizer.detokenizer()
    pieces = [detok.feed([i]) for i in ids] + [detok.flush()]
    return pieces


def test_byte_tokenizer_round_trip_and_incremental():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids[0] == 256 and tok.decode(ids) == TEXT
    pieces = stream(tok, ids + [257])
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in p for p in pieces)
    assert sum(1 for p in pieces if p == "") >= 4  # multi-byte characters were held back


def test_byte_tokenizer_flushes_a_truncated_character():
    tok = ByteTokenizer()
    detok = tok.detokenizer()
    assert detok.feed(list("🦙".encode())[:2]) == ""
    assert detok.flush() == "\ufffd"


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world", "the quick brown fox", TEXT] * 20, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_hf_tokenizer_incremental_detokenize(hf_tokenizer):
    tok = HFTokenizer(str(hf_tokenizer))
    text = "the 🦙 says hello wörld 日本"
    ids = tok.encode(text)
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_load_tokenizer_picks_hf_when_present(hf_tokenizer):
    config = ModelConfig(tokenizer="hf")
    assert isinstance(load_tokenizer(config, str(hf_tokenizer.parent)), HFTokenizer)
    assert isinstance(load_tokenizer(ModelConfig()), ByteTokenizer)
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(config, None)
