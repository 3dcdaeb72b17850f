"""Structured output (engine/structured_output.py) through the engine, with the trained
tiny model, async scheduling on (the default) and off: every constraint kind yields text
the constraint accepts over many seeds; greedy constrained output equals an unbatched
reference (full-sequence forward, NumPy mask, argmax); unconstrained neighbours are
untouched; malformed constraints are refused by name and cost nothing."""

import json
import re

import jax
import numpy as np
import pytest
from flax import nnx

from jaxfill import Engine, SamplingParams, StructuredOutput
from jaxfill.engine.config import load_config
from jaxfill.engine.request import InvalidRequest
from jaxfill.engine.structured_output import GrammarCompiler, grammar_text
from fast_engine import REFERENCE_ATTENTION

ENGINE = {**REFERENCE_ATTENTION,  # tests/fast_engine.py
          "engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64], "engine.num_pages": 96,
          "engine.max_model_len": 256, "engine.max_num_seqs": 8}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
LARK = 'start: "(" WORD ("," WORD)? ("," WORD)? ")"\nWORD: /[a-z]{1,5}/'
GBNF = 'root ::= ("yes" | "no") " " [0-9]'
CHOICES = ("Romeo", "Juliet", "Mercutio")


def accepts(kind: str, text: str) -> bool:
    if kind in ("json_schema", "json_object"):
        try:
            value = json.loads(text)
        except ValueError:
            return False
        if kind == "json_object":
            return isinstance(value, dict)
        return (isinstance(value, dict) and set(value) == {"name", "age"}
                and re.fullmatch(r"[A-Za-z]{1,8}", value["name"]) is not None
                and type(value["age"]) is int and 0 <= value["age"] <= 150)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "grammar":
        return re.fullmatch(r"\([a-z]{1,5}(,[a-z]{1,5}){0,2}\)", text) is not None
    if kind == "gbnf":
        return re.fullmatch(r"(yes|no) [0-9]", text) is not None
    return text in CHOICES


CONSTRAINTS = {"json_schema": StructuredOutput("json_schema", SCHEMA), "json_object": StructuredOutput("json_object"),
               "regex": StructuredOutput("regex", REGEX), "grammar": StructuredOutput("grammar", LARK),
               "gbnf": StructuredOutput("grammar", GBNF), "choice": StructuredOutput("choice", CHOICES)}


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def engine(request):
    with Engine(load_config("tiny", {**ENGINE, "engine.async_scheduling": request.param}), progress=False) as e:
        yield e


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_every_kind_yields_text_the_constraint_accepts(engine, kind):
    so = CONSTRAINTS[kind]
    params = [SamplingParams(max_tokens=96, temperature=1.0, seed=seed, structured_output=so) for seed in range(8)]
    done = engine.generate(["ROMEO:\n"] * 4 + ["Hello"] * 4, params)
    finished = [c for c in done if c.finish_reason == "stop"]
    # json_object alone is unbounded (any object): it may run out of tokens; the rest end.
    assert len(finished) >= (4 if kind == "json_object" else 8), [(c.text, c.finish_reason) for c in done]
    for c in finished:
        assert accepts(kind, c.text), (kind, c.text)
    assert len({c.text for c in done}) > 1 or kind == "choice"  # the seeds draw, not one forced answer


def test_unconstrained_neighbours_are_untouched(engine):
    plain = [SamplingParams(max_tokens=12, temperature=0.8, seed=s) for s in range(3)]
    alone = engine.generate(["ROMEO:\n"] * 3, plain)
    mixed = engine.generate(["ROMEO:\n"] * 4, plain + [SamplingParams(max_tokens=12, structured_output=CONSTRAINTS["regex"])])
    assert [c.token_ids for c in mixed[:3]] == [c.token_ids for c in alone]
    assert accepts("regex", mixed[3].text)


@pytest.fixture(scope="module")
def tiny_logits():
    """The trained tiny model's full-sequence forward (the training one, not the engine's):
    ids -> logits of the last row."""
    from jaxfill.models.checkpoint import load_hf_params
    from test_tiny_trained import TINY_DIR, load_script, tiny_model_config

    train = load_script("train")
    model = load_hf_params(TINY_DIR, tiny_model_config(), progress=False)
    params = nnx.to_pure_dict(nnx.split(model)[1])
    forward = jax.jit(train.train_forward, static_argnums=2)

    def last_logits(ids: list[int]) -> np.ndarray:  # [V]
        padded = np.zeros((1, 128), np.int32)  # one compiled shape; causal, so the padding is unseen
        padded[0, :len(ids)] = ids
        return np.asarray(forward(params, padded, model.config))[0, len(ids) - 1]
    return last_logits


def reference_greedy(last_logits, tokenizer, prompt: list[int], so, max_tokens: int) -> list[int]:
    """One sequence, no engine: the grammar's mask applied in NumPy, argmax."""
    import llguidance.numpy as lln

    grammars = GrammarCompiler(320)
    matcher = grammars.matcher(grammar_text(so), tokenizer)
    ids, out = list(prompt), []
    mask = lln.allocate_token_bitmask(1, 320)
    while len(out) < max_tokens and not matcher.is_stopped():
        logits = last_logits(ids)
        lln.fill_next_token_bitmask(matcher, mask, 0)
        ok = np.unpackbits(mask.view(np.uint8), bitorder="little")[:len(logits)].astype(bool)
        token = int(np.argmax(np.where(ok, logits, -np.inf)))
        out.append(token)
        ids.append(token)
        if token in tokenizer.eos_token_ids:
            break
        matcher.consume_token(token)
    return out


@pytest.mark.parametrize("kind", ["json_schema", "regex", "grammar"])
def test_greedy_constrained_equals_an_unbatched_reference(engine, tiny_logits, kind):
    so = CONSTRAINTS[kind]
    crowd = [SamplingParams(max_tokens=20, temperature=0.9, seed=s) for s in range(3)]
    done = engine.generate(["Hello", "ROMEO:\n", "To be", "Hello"],
                           crowd[:2] + [SamplingParams(max_tokens=40, structured_output=so)] + crowd[2:])
    expected = reference_greedy(tiny_logits, engine.tokenizer, engine.tokenizer.encode("To be"), so, 40)
    assert done[2].token_ids == expected
    assert accepts(kind, done[2].text)


def test_stop_strings_still_end_a_constrained_request(engine):
    out = engine.generate(["x"], SamplingParams(max_tokens=20, stop=["-"], structured_output=CONSTRAINTS["regex"]))[0]
    assert out.finish_reason == "stop" and re.fullmatch(r"[0-9]{3}", out.text)


@pytest.mark.parametrize("so,field", [
    (StructuredOutput("regex", "([a-z"), "structured_output.regex"),
    (StructuredOutput("json_schema", "{not json"), "structured_output.json_schema"),
    (StructuredOutput("json_schema", {"type": "objectx"}), "structured_output.json_schema"),
    (StructuredOutput("grammar", "root ::= ("), "structured_output.grammar"),
    (StructuredOutput("choice", ()), "structured_output.choice"),
    (StructuredOutput("regex", ""), "structured_output.regex"),
    (StructuredOutput("xml", "<a/>"), "structured_output"),
])
def test_malformed_constraints_are_refused_by_name(engine, so, field):
    before = engine.stats()["pages_free"]
    with pytest.raises(InvalidRequest) as e:
        engine.generate(["abc"], SamplingParams(structured_output=so))
    assert e.value.field == field, str(e.value)
    assert engine.stats()["pages_free"] == before
    assert engine.generate(["abc"], SamplingParams(max_tokens=3))[0].finish_reason == "length"


def test_an_hf_bpe_tokenizer_with_a_padded_vocabulary(tmp_path):
    """The HF path of llg_tokenizer: a byte-level BPE tokenizer.json, the model's vocabulary
    padded past it. Random draws among the allowed tokens spell text the regex accepts, and
    ids past the tokenizer's are never allowed."""
    import llguidance.numpy as lln
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from jaxfill.engine.structured_output import fill_bitmask
    from jaxfill.engine.tokenizer import HFTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"])
    tok.train_from_iterator(["name: 123-abc, the quick brown fox 42-xyz"] * 50, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(str(tmp_path / "tokenizer.json"), eos_token_ids=(tok.token_to_id("<eos>"),))
    vocab = 512  # the model's rows, past the tokenizer's ~400
    grammars = GrammarCompiler(vocab)
    rng = np.random.default_rng(0)
    for _ in range(5):
        matcher = grammars.matcher(grammars.check(StructuredOutput("regex", REGEX), hf), hf)
        row = lln.allocate_token_bitmask(1, vocab)[0]
        out = []
        while not matcher.is_stopped() and len(out) < 40:
            fill_bitmask(matcher, row)
            ok = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab].astype(bool)
            assert not ok[hf.vocab_size:].any()
            token = int(rng.choice(np.flatnonzero(ok)))
            if token in hf.eos_token_ids:
                break
            out.append(token)
            matcher.consume_token(token)
        assert accepts("regex", hf.decode(out)), hf.decode(out)
