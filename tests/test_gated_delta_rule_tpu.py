"""The gated delta rule's Pallas TPU kernel (pallas_kernels/gated_delta_rule_tpu.py) under
the TPU interpreter (uninitialized memory NaN, out-of-bounds reads raising) against the
float64 oracle of tests/test_gated_delta_rule.py: the same ragged batch (a long chunk, a
short one, two decodes, NaN padding rows and a NaN unused state slot), chunks of 8 and
16 (the interpreter is slow: small cases); the unused slot stays untouched. Decodes
between chunks and a decode-only step (no chunk for the kernel: each state block must
come back as XLA's decode step left it, not as uninitialised NaN). And the
kernel lowers for TPU with Mosaic (jax.export) at Qwen3.5's shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jaxfill.pallas_kernels.gated_delta_rule_tpu import gated_delta_rule_tpu
from scan_checks import check_against_oracle, check_kernel_model_equals_xla
from test_gated_delta_rule import BATCHES, check, inputs, oracle, run


@pytest.mark.parametrize("chunk", [8, 16])
def test_equals_the_float64_recurrence(chunk):
    args = inputs(np.random.default_rng(0))
    want_o, want_states = oracle(*args)
    o, st = run(gated_delta_rule_tpu, *args, chunk=chunk)
    check_against_oracle(o, st, want_o, want_states, 1e-4)


@pytest.mark.parametrize("batch", ["decodes_between_chunks", "decodes_only"])
def test_decodes_beside_and_without_chunks(batch):
    args = inputs(np.random.default_rng(0), *BATCHES[batch])
    check(*run(gated_delta_rule_tpu, *args, chunk=8), *oracle(*args))


def test_lowers_for_tpu_at_qwen3_5_shapes():
    """A 2048-token step, 32 value heads of 128 x 128 (Qwen3.5-9B), 64-token chunks."""
    t, h, d, s = 2048, 32, 128, 8
    f32 = jnp.float32
    args = (jax.ShapeDtypeStruct((t, h, d), f32),) * 3 + (jax.ShapeDtypeStruct((t, h), f32),) * 2 + (
        jax.ShapeDtypeStruct((s + 1,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32),
        jax.ShapeDtypeStruct((s, h, d, d), f32))
    fn = lambda *a: gated_delta_rule_tpu(*a, chunk=64, interpret=False)  # noqa: E731
    exp = export.export(jax.jit(fn), platforms=["tpu"])(*args)
    assert "tpu_custom_call" in exp.mlir_module()
    assert exp.out_avals[0].shape == (t, h, d) and exp.out_avals[1].shape == (s, h, d, d)


@pytest.mark.slow
def test_the_model_with_the_kernel_equals_the_xla_loop(monkeypatch):
    """A random Qwen3.5-shaped hybrid (4 layers, DeltaNet 2 key / 4 value heads of 16)."""
    from jaxfill.models.mixers import gated_deltanet

    check_kernel_model_equals_xla({
        "model.architecture": "Qwen3_5ForCausalLM", "model.hidden_size": 64, "model.intermediate_size": 128,
        "model.num_layers": 4, "model.num_heads": 4, "model.num_kv_heads": 2, "model.head_dim": 16,
        "model.rotary_dim": 4, "model.linear_layers": [0, 1, 2], "model.linear_num_key_heads": 2,
        "model.linear_num_value_heads": 4, "model.linear_key_head_dim": 16, "model.linear_value_head_dim": 16},
        gated_deltanet, "gated_delta_rule_tpu", monkeypatch)
