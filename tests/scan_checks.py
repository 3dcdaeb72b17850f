"""The checks every linear rule's tests share (tests/test_gated_delta_rule*.py,
tests/test_ssd*.py): the rule against its float64 oracle on a ragged batch, and a model
running the rule's Pallas TPU kernel against the same model on the XLA loop."""

import dataclasses

import numpy as np
from flax import nnx

from jaxfill.engine.config import load_config
from jaxfill.engine.simple import prefill_chunks
from jaxfill.models.families.registry import new_model
from jaxfill.models.kv_cache import KVCache


def check_against_oracle(out: np.ndarray,  # [T, H, V] the rule's output (padding rows after the live ones)
                         states: np.ndarray,  # [S+1, H, K, V] its final states (the last slot unused, NaN)
                         want_out: np.ndarray,  # [live rows, H, V] float64
                         want_states: np.ndarray,  # [S+1, H, K, V] float64 (the last slot unused)
                         tol: float = 1e-4) -> None:
    """The live rows' outputs and the sequences' final states equal the oracle's and are
    finite; the unused slot is neither read nor written."""
    live, s = want_out.shape[0], want_states.shape[0] - 1
    assert np.isfinite(out[:live]).all() and np.isfinite(states[:s]).all()
    np.testing.assert_allclose(out[:live], want_out, rtol=tol, atol=tol)
    np.testing.assert_allclose(states[:s], want_states[:s], rtol=tol, atol=tol)
    assert np.isnan(states[s]).all()


def check_kernel_model_equals_xla(overrides: dict,  # tiny_random's model.* overrides: a small hybrid
                                  module, name: str,  # the layer module and the kernel's name in it
                                  monkeypatch) -> None:
    """With model.linear_impl = pallas_tpu the model gives the XLA loop's logits on a
    40-token prefill in steps of 16, 16 and 8 tokens (8 padding rows; one compile) with the
    state carried through its slot, so the third step sees the second's decay of the
    first's state; and the kernel ran (traced once per layer)."""
    config = load_config("tiny_random", overrides).model
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, config.vocab_size, 40)]
    kernel, calls = getattr(module, name), []
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    out = {}
    for impl in ("xla", "pallas_tpu"):
        c = config.replace(linear_impl=impl)
        cache = KVCache.create(c, num_pages=8, page_size=16, fill_value=float("nan"), state_slots=2)
        logits, _ = prefill_chunks(new_model(c, nnx.Rngs(0)), prompt, cache, [1, 2, 3], chunk=16)
        out[impl] = np.asarray(logits)
    assert calls
    assert np.isfinite(out["pallas_tpu"]).all()
    np.testing.assert_allclose(out["pallas_tpu"], out["xla"], rtol=1e-5, atol=1e-5)
