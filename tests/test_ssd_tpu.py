"""Mamba2's SSD scan as a Pallas TPU kernel (pallas_kernels/ssd_tpu.py) under the TPU
interpreter (uninitialized memory NaN, out-of-bounds reads raising) against the float64
oracle of tests/test_ssd.py, on its ragged batch: a 37-token chunk continuing from a
nonzero state, a fresh 5-token prefill (a zero state), two decodes, NaN padding rows and
a NaN unused state slot, in chunks of 8 and 16 (the interpreter is slow: small cases);
the unused slot stays untouched, and a step with no live sequence writes no state. The
Nemotron-H model with it == the XLA loop; the kernel lowers for TPU with Mosaic
(jax.export) at Nemotron-H-8B's shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jaxfill.pallas_kernels.ssd_tpu import ssd_tpu
from scan_checks import check_against_oracle, check_kernel_model_equals_xla
from test_ssd import LENS, inputs, oracle, run


def batch():
    args = inputs(np.random.default_rng(0))
    args[7][1] = 0.0  # states: the second sequence is a fresh prefill
    return args


@pytest.mark.parametrize("chunk", [8, 16])
def test_equals_the_float64_recurrence(chunk):
    args = batch()
    want_y, want_states = oracle(*args)
    y, st = run(chunk, *args, rule=ssd_tpu)
    check_against_oracle(y, st, want_y, want_states, 1e-5)


def test_no_live_sequence_leaves_every_state_as_it_was():
    """num_seqs = 0 (a padding-only step): the kernel runs no chunk, and the state block it
    holds must go back as it was read, not as an unwritten VMEM buffer."""
    args = batch()
    y, st = run(8, *args, rule=ssd_tpu, num_seqs=0)
    np.testing.assert_array_equal(st, args[7].astype(np.float32))
    assert np.isfinite(st[:len(LENS)]).all() and (y == 0).all()


def test_lowers_for_tpu_at_nemotron_h_8b_shapes():
    """A 2048-token step, Nemotron-H-8B's 128 Mamba heads of 64 over a 128-wide state in 8
    groups, 64-token chunks (what the model uses)."""
    from jaxfill.engine.config import load_config

    m = load_config("nemotron_h_8b").model
    t, s, g, n, h, p = 2048, 8, m.linear.num_key_heads, m.linear.key_head_dim, m.linear.num_value_heads, \
        m.linear.value_head_dim
    assert (g, n, h, p) == (8, 128, 128, 64)
    f32, spec = jnp.float32, jax.ShapeDtypeStruct
    args = (spec((t, h, p), f32), spec((t, h), f32), spec((h,), f32), spec((t, g, n), f32), spec((t, g, n), f32),
            spec((h,), f32), spec((s + 1,), jnp.int32), spec((1,), jnp.int32), spec((s, h, n, p), f32))
    fn = lambda *a: ssd_tpu(*a, chunk=64, interpret=False)  # noqa: E731
    exp = export.export(jax.jit(fn), platforms=["tpu"])(*args)
    assert "tpu_custom_call" in exp.mlir_module()
    assert exp.out_avals[0].shape == (t, h, p) and exp.out_avals[1].shape == (s, h, n, p)


def test_the_model_with_the_kernel_equals_the_xla_loop(monkeypatch):
    """A random Nemotron-H of pattern M* (a Mamba2 layer of 2 groups, 4 heads of 8 over an
    8-wide state, then attention)."""
    from jaxfill.models.mixers import mamba2

    check_kernel_model_equals_xla({
        "model.architecture": "NemotronHForCausalLM", "model.hidden_size": 64, "model.intermediate_size": 128,
        "model.num_layers": 2, "model.num_heads": 4, "model.num_kv_heads": 2, "model.head_dim": 16,
        "model.linear_layers": [0], "model.no_mlp_layers": [0, 1], "model.no_mixer_layers": [],
        "model.nope_layers": [1], "model.linear_num_key_heads": 2, "model.linear_num_value_heads": 4,
        "model.linear_key_head_dim": 8, "model.linear_value_head_dim": 8}, mamba2, "ssd_tpu", monkeypatch)
