"""prompt_logprobs: each prompt token's logprob given the tokens before it, plus the top-k,
computed in the prefill pass (engine/step.py's scoring program) — against a transformers
full-sequence log-softmax of the same checkpoint, through chunked prefill, beside other
requests, and with the prefix cache (a cached prefix is recomputed, never served)."""

import numpy as np
import pytest

from jaxfill import Engine, SamplingParams
from jaxfill.engine.config import load_config
from jaxfill.engine.request import InvalidRequest
from fast_engine import REFERENCE_ATTENTION

ENGINE = {**REFERENCE_ATTENTION,  # tests/fast_engine.py
          "engine.num_pages": 96, "engine.max_model_len": 256, "engine.max_num_seqs": 4}
TEXT = "ROMEO:\nBut soft, what light through yonder window breaks? It is the east."


@pytest.fixture(scope="module")
def reference():
    """transformers' log-softmax over the whole text, f32: [T, V]."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from test_tiny_trained import TINY_DIR

    model = transformers.AutoModelForCausalLM.from_pretrained(TINY_DIR, dtype=torch.float32)

    def logprobs(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1).numpy()
    return logprobs


@pytest.fixture(scope="module", params=["budget16", "budget64"])
def engine(request):
    """Budget 16 with 8 scored rows a step: a 72-token prompt is scored over 9+ chunks."""
    small = request.param == "budget16"
    overrides = {**ENGINE, "engine.max_num_batched_tokens": 16 if small else 64,
                 "engine.token_buckets": [16] if small else [16, 64],
                 "engine.prompt_logprobs_rows": 8 if small else 64}
    with Engine(load_config("tiny", overrides), progress=False) as e:
        yield e


def check_against(reference, ids: list[int], entries, k: int) -> None:
    lp = reference(ids)
    assert len(entries) == len(ids) and entries[0] is None
    for i, e in enumerate(entries[1:]):
        assert e["token_id"] == ids[i + 1]
        assert abs(e["logprob"] - lp[i, ids[i + 1]]) < 1e-4, (i, e["logprob"], lp[i, ids[i + 1]])
        assert len(e["top"]) == k
        want = np.sort(lp[i])[::-1][:k]
        np.testing.assert_allclose([v for _, v in e["top"]], want, atol=1e-4)
        assert all(abs(lp[i, t] - v) < 1e-4 for t, v in e["top"])


@pytest.mark.slow
def test_prompt_logprobs_equal_transformers(engine, reference):
    ids = engine.tokenizer.encode(TEXT)
    done = engine.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=5))[0]
    check_against(reference, ids, done.prompt_logprobs, 5)


def test_beside_other_requests_nothing_else_changes(engine, reference):
    ids = engine.tokenizer.encode(TEXT)
    plain = [SamplingParams(max_tokens=6, temperature=0.8, seed=s) for s in range(2)]
    alone = engine.generate(["Hello", "To be"], plain)
    scored_alone = engine.generate([ids], SamplingParams(max_tokens=6))[0]
    mixed = engine.generate(["Hello", ids, "To be"],
                            [plain[0], SamplingParams(max_tokens=6, prompt_logprobs=2), plain[1]])
    assert [mixed[0].token_ids, mixed[2].token_ids] == [c.token_ids for c in alone]
    assert mixed[1].token_ids == scored_alone.token_ids  # its own sampling is the usual one
    assert alone[0].prompt_logprobs is None
    check_against(reference, ids, mixed[1].prompt_logprobs, 2)


@pytest.mark.slow
def test_a_cached_prefix_is_recomputed_not_served(engine):
    ids = engine.tokenizer.encode(TEXT)
    engine.generate([ids], SamplingParams(max_tokens=2))  # caches the prompt's pages
    first = engine.generate([ids], SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
    again = engine.generate([ids], SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
    assert first.cached_tokens == 0 and again.cached_tokens == 0
    assert [e and e["logprob"] for e in first.prompt_logprobs] == [e and e["logprob"] for e in again.prompt_logprobs]
    assert engine.generate([ids], SamplingParams(max_tokens=2))[0].cached_tokens > 0  # others still hit
    st = engine.stats()
    assert st["num_running"] == 0 and st["pages_free"] + st["pages_cached"] >= st["pages_total"] - 1


def test_first_streamed_output_carries_them(engine):
    ids = engine.tokenizer.encode("Hello there")
    outs = list(engine.stream(ids, SamplingParams(max_tokens=3, prompt_logprobs=0)))
    with_prompt = [o for o in outs if o.prompt_logprobs is not None]
    assert len(with_prompt) == 1 and with_prompt[0] is outs[0]
    assert len(outs[0].prompt_logprobs) == len(ids) and all(len(e["top"]) == 0 for e in outs[0].prompt_logprobs[1:])


@pytest.mark.parametrize("value", [-1, 21, 2.5])
def test_bad_values_are_refused_by_name(engine, value):
    with pytest.raises(InvalidRequest) as e:
        engine.generate(["abc"], SamplingParams(prompt_logprobs=value))
    assert e.value.field == "prompt_logprobs"


@pytest.mark.slow
def test_without_chunked_prefill_a_prompt_over_the_rows_is_refused():
    overrides = {**ENGINE, "engine.max_num_batched_tokens": 64, "engine.token_buckets": [64],
                 "engine.prompt_logprobs_rows": 16, "engine.chunked_prefill": False}
    with Engine(load_config("tiny", overrides), progress=False) as e:
        ok = e.generate(["x" * 10], SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
        assert len(ok.prompt_logprobs) == 11 and ok.prompt_logprobs[1] is not None
        with pytest.raises(InvalidRequest) as err:
            e.generate(["x" * 40], SamplingParams(max_tokens=2, prompt_logprobs=1))
        assert err.value.field == "prompt_logprobs"
