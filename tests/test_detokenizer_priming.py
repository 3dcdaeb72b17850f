"""Detokenizers primed with the prompt stream exactly what the output adds to its text.

Property: the concatenated pieces equal decode(prompt + output) minus its longest common
prefix with decode(prompt) (that prefix is decode(prompt) itself unless the prompt ends in
a broken character the output completes). Checked on a Metaspace tokenizer (Mistral-style
decoder), a Llama-2-style one (byte fallback, Replace/ByteFallback/Fuse/Strip decoder), a
byte-level BPE and the byte tokenizer; all built offline.
"""

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from jaxfill.engine.tokenizer import ByteTokenizer, HFTokenizer
from fast_engine import REFERENCE_ATTENTION

CORPUS = ["hello world", "the quick brown fox jumps over the lazy dog", "Hello there, how are you?",
          "héllo wörld — 日本語 and emoji 🦙🚀 done", "naïve café ∑ résumé"] * 20
SPECIALS = ["<unk>", "<s>", "</s>"]


def _metaspace(path):
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS))
    tok.save(path)


def _llama2(path):
    """Llama 2's tokenizer.json layout: no pre-tokenizer, byte-fallback tokens <0xXX>."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", max(vocab.values()) + 1)
    Tokenizer.from_str(json.dumps(spec)).save(path)


def _byte_level(path):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(path)


BUILDERS = {"metaspace": _metaspace, "llama2": _llama2, "byte_level": _byte_level}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("detok")
    out = {"bytes": ByteTokenizer()}
    for name, build in BUILDERS.items():
        os.makedirs(root / name)
        build(str(root / name / "tokenizer.json"))
        out[name] = HFTokenizer(str(root / name / "tokenizer.json"))
    return out


def expected_stream(tok, prompt, output):
    full, head = tok.decode(prompt + output), tok.decode(prompt)
    n = next((i for i, (a, b) in enumerate(zip(head, full)) if a != b), min(len(head), len(full)))
    return full[n:]


def stream(tok, prompt, output):
    detok = tok.detokenizer(prompt)
    # A half character emitted as U+FFFD would make the concatenation differ from the decode.
    return "".join(detok.feed([i]) for i in output) + detok.flush()


NAMES = ["bytes", *BUILDERS]
# Characters in CORPUS (merged tokens) and not (byte tokens): € ж 🎉.
TEXT = st.text(st.sampled_from("ab hé wörld 日本 🦙∑.,\n€ж🎉"), min_size=1, max_size=24)


@pytest.mark.parametrize("name", NAMES)
def test_first_output_token_keeps_its_leading_space(tokenizers, name):
    tok = tokenizers[name]
    prompt = tok.encode("Hello", add_bos=False)
    # SentencePiece-style tokenizers mark a word's leading space in the word's own token.
    output = tok.encode("world" if name in ("metaspace", "llama2") else " world", add_bos=False)
    assert tok.decode(prompt + output) == "Hello world"
    assert stream(tok, prompt, output) == " world"


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_stream_equals_decoded_difference(tokenizers, name, data):
    tok = tokenizers[name]
    # Arbitrary ids (a model may emit anything), except Llama 2's byte tokens: its
    # ByteFallback decoder turns a whole invalid run of them into U+FFFDs, rewriting text
    # already streamed, which no streaming detokenizer can match. Text-made ids still
    # cover byte-fallback characters split across tokens.
    top = tok.tok.token_to_id("<0x00>") if name == "llama2" else tok.vocab_size
    ids = st.lists(st.integers(0, top - 1), min_size=1, max_size=20)
    from_text = TEXT.map(lambda text: tok.encode(text, add_bos=False))
    prompt = data.draw(from_text | ids, "prompt")
    output = data.draw(from_text | ids, "output")
    assert stream(tok, prompt, output) == expected_stream(tok, prompt, output)


@pytest.mark.parametrize("name", ["bytes", "byte_level", "llama2"])
def test_character_split_between_prompt_and_output(tokenizers, name):
    """A prompt cut inside a multi-byte character: the output's bytes complete it."""
    tok = tokenizers[name]
    splits = 0
    for text in ["ab € cd", "x 🎉 y", "жж"]:  # not in CORPUS: byte tokens, unmerged
        ids = tok.encode(text, add_bos=False)
        for cut in range(1, len(ids)):
            head = tok.decode(ids[:cut])
            splits += head.endswith("\ufffd")
            got = stream(tok, ids[:cut], ids[cut:])
            assert got == expected_stream(tok, ids[:cut], ids[cut:])
            assert head.replace("\ufffd", "") + got == text
    assert splits >= 3


@pytest.mark.slow
def test_engine_stream_equals_decoded_difference(tokenizers):
    """Engine.add_request primes each request's detokenizer with its prompt."""
    from jaxfill.engine.config import load_config
    from jaxfill.engine.engine import Engine
    from jaxfill.engine.request import SamplingParams

    tok = tokenizers["metaspace"]
    over = {**REFERENCE_ATTENTION, "engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64],
            "engine.num_pages": 64, "engine.max_model_len": 256, "model.vocab_size": tok.vocab_size, "model.bos_token_id": 1,
            "model.eos_token_id": [2]}
    eng = Engine(load_config("tiny_random", over), progress=False)
    eng.tokenizer = tok  # tiny_random's shapes with a SentencePiece-style tokenizer
    prompts = [tok.encode(t, add_bos=False) for t in ["Hello there", "the quick brown", "naïve", "日本"]]
    rids = [eng.add_request(p, SamplingParams(max_tokens=8, temperature=1.0, seed=i, ignore_eos=True))
            for i, p in enumerate(prompts)]
    text = dict.fromkeys(rids, "")
    ids = {r: [] for r in rids}
    while eng.has_unfinished():
        for out in eng.step():
            text[out.request_id] += out.new_text
            ids[out.request_id] += out.new_token_ids
    spaced = 0
    for r, p in zip(rids, prompts):
        assert text[r] == expected_stream(tok, p, ids[r])
        spaced += tok.tok.id_to_token(ids[r][0]).startswith("▁")
    assert spaced >= 1  # a cold-start detokenizer would have dropped that space
