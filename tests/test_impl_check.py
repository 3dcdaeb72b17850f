"""The warm-up check of the attention impl (engine/runner.py, ragged_paged_attention/
self_check.py): an impl that fails to lower, or lowers and gives wrong numbers, is
replaced by xla with one warning, and the engine really serves with xla; a correct impl
is kept."""

import logging

import pytest
from flax import nnx

from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
from jaxfill.pallas_kernels import IMPLS
from jaxfill.pallas_kernels.ragged_paged_attention.self_check import check_impl

OVERRIDES = {"engine.max_num_batched_tokens": 16, "engine.token_buckets": [16], "engine.max_num_seqs": 4,
             "engine.num_pages": 32, "engine.max_model_len": 128, "engine.page_size": 8}
PROMPTS = [[5, 17, 99, 3, 250, 8, 41, 77, 12, 9, 1, 64, 200, 33], [120, 7, 7, 31]]
BROKEN = {"mosaic_off_tpu": "Only interpret mode", "rows_shifted": "relative error"}


@pytest.fixture(autouse=True)
def broken_impls(monkeypatch):
    for name in (*BROKEN, "reference_twin"):
        monkeypatch.setitem(IMPLS, name, ("broken_impls", name))


def engine(impl):
    return Engine.from_config("tiny_random", overrides={**OVERRIDES, "engine.attention_impl": impl},
                              progress=False)


def served_impl(runner) -> str:
    return nnx.merge(runner.graphdef, runner.state).attention_impl  # what the compiled step runs


def tokens(eng):
    return [c.token_ids for c in eng.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0))]


@pytest.fixture(scope="module")
def xla_tokens():
    return tokens(engine("xla"))


@pytest.mark.parametrize("impl", sorted(BROKEN))
def test_check_impl_names_the_failure(impl):
    error = check_impl(impl, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=8)
    assert error is not None and BROKEN[impl] in error


def test_check_impl_passes_a_correct_impl():
    assert check_impl("reference", num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=8) is None


@pytest.mark.slow
@pytest.mark.parametrize("impl", sorted(BROKEN))
def test_failing_impl_falls_back_to_xla_and_serves(impl, caplog, xla_tokens):
    with caplog.at_level(logging.WARNING, logger="jaxfill.runner"):
        eng = engine(impl)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and impl in warnings[0].getMessage() and "serving with xla" in warnings[0].getMessage()
    assert eng.runner.attention_impl == "xla" and served_impl(eng.runner) == "xla"
    assert BROKEN[impl] in eng.runner.attention_check
    assert tokens(eng) == xla_tokens


def test_correct_impl_is_kept(caplog, xla_tokens):
    with caplog.at_level(logging.WARNING, logger="jaxfill.runner"):
        eng = engine("reference_twin")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert eng.runner.attention_impl == "reference_twin" and served_impl(eng.runner) == "reference_twin"
    assert "matches xla" in eng.runner.attention_check
    assert tokens(eng) == xla_tokens


def test_reference_serves_unchecked_and_gives_xla_tokens(xla_tokens):
    """The oracle impl skips the check (it would compile xla for nothing) and still serves
    the xla impl's tokens: the suite's engine tests use it for its cheaper compile."""
    eng = engine("reference")
    assert eng.runner.attention_impl == "reference" and "baseline" in eng.runner.attention_check
    assert tokens(eng) == xla_tokens
