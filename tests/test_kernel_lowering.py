"""The Pallas kernels lower for the hardware they target, checked from this CPU machine.

`jax.export` with `platforms=["tpu"]` runs the real Mosaic TPU lowering of pallas_tpu,
and `platforms=["cuda"]` the real Triton lowering of pallas_gpu and the real Mosaic GPU
lowering of mosaic_gpu (down to NVVM: TMA and wgmma ops; arch sm_90 because no device
names another, jax.experimental.mosaic.gpu's `_infer_arch`), without the hardware.
Lowering is not compiling (Mosaic's and Triton's final compiles happen on the device),
but a kernel that fails here would fail on every TPU/GPU: this catches it first.
Cases: every preset's (head_dim, dtype, page_size, query group) at the engine's
prefill- and decode-sized buckets.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import export

from jaxfill.engine.batch import bucket_shapes
from jaxfill.engine.config import load_config, preset_names
from jaxfill.pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu
from jaxfill.pallas_kernels.ragged_paged_attention.mosaic_gpu import ragged_paged_attention_mosaic_gpu
from jaxfill.pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu

TRITON_CALL = "__gpu$xla.gpu.triton"
MOSAIC_GPU_CALL = "mosaic_gpu_v2"


def _preset_shapes() -> dict[tuple, str]:
    """(head_dim, dtype, page_size, Hq, Hkv, sliding_window) -> the first preset with it;
    Hq/Hkv cut to one KV head's group (the kernels grid over KV heads, so more heads lower
    the same)."""
    shapes = {}
    for name in preset_names():
        c = load_config(name)
        m, e = c.model, c.engine
        group = m.num_heads // m.num_kv_heads
        shapes.setdefault((m.head_dim, m.dtype, e.page_size, group, 1, m.attention.sliding_window), name)
    return shapes


def _buckets(name: str) -> list[tuple[int, int]]:
    """The engine's smallest (decode-sized) and largest (prefill-sized) step buckets."""
    shapes = sorted(bucket_shapes(load_config(name).engine))
    return sorted({shapes[0], shapes[-1]})


CASES = [(name, key, t, s) for key, name in sorted(_preset_shapes().items(), key=lambda kv: kv[1])
         for t, s in _buckets(name)]


def _args(key, num_tokens: int, num_seqs: int, max_pages: int = 64, num_pages: int = 128):
    head_dim, dtype, page_size, hq, hkv, _ = key
    dt = jnp.dtype(dtype)
    return (jax.ShapeDtypeStruct((num_tokens, hq, head_dim), dt),  # q [T, Hq, D]
            jax.ShapeDtypeStruct((num_pages, page_size, 2 * hkv, head_dim), dt),  # kv_pages
            jax.ShapeDtypeStruct((num_seqs,), jnp.int32),  # kv_lens [S]
            jax.ShapeDtypeStruct((num_seqs, max_pages), jnp.int32),  # page_indices [S, P]
            jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32),  # cu_q_lens [S+1]
            jax.ShapeDtypeStruct((1,), jnp.int32))  # num_seqs [1]


def _ids(case) -> str:
    name, key, t, s = case
    window = f"-W{key[5]}" if key[5] else ""
    return f"{name}-D{key[0]}-{key[1]}-G{key[3]}{window}-T{t}xS{s}"


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_pallas_tpu_lowers_with_mosaic(case):
    _, key, t, s = case
    fn = functools.partial(ragged_paged_attention_tpu, sm_scale=key[0] ** -0.5, sliding_window=key[5],
                           interpret=False)
    exp = export.export(jax.jit(fn), platforms=["tpu"])(*_args(key, t, s))
    text = exp.mlir_module()
    assert "tpu_custom_call" in text, "no Mosaic kernel in the lowered module"
    assert exp.out_avals[0].shape == (t, key[3], key[0])


def _on_an_h200():
    """jax >= 0.11.2's Triton lowering asks for the GPU's compute capability and, off a
    GPU, fails with "No supported GPU devices found" unless an abstract device names one."""
    from jax.sharding import AbstractDevice, AbstractMesh

    device = AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    return jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=device))


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_pallas_gpu_lowers_with_triton(case):
    _, key, t, s = case
    fn = functools.partial(ragged_paged_attention_gpu, sm_scale=key[0] ** -0.5, sliding_window=key[5],
                           interpret=False)
    checks = [export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
    if key[0] & (key[0] - 1):  # Phi-3's 96: refused by name, not a Triton error from deep inside
        with pytest.raises(ValueError, match="power-of-two head_dim"), _on_an_h200():
            export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*_args(key, t, s))
        return
    with _on_an_h200():
        exp = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*_args(key, t, s))
    assert TRITON_CALL in exp.mlir_module(), "no Triton kernel in the lowered module"
    assert exp.out_avals[0].shape == (t, key[3], key[0])


def _mosaic_gpu_refuses(key) -> str | None:
    """What mosaic_gpu refuses in this preset shape (its docstring's list), else None."""
    head_dim, dtype, page_size, group = key[:4]
    if dtype != "bfloat16":
        return f"q dtype {dtype}"
    if head_dim % 32 or head_dim > 256:
        return f"head_dim {head_dim}"
    if group > 64:
        return f"query group {group}"
    return None


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_mosaic_gpu_lowers_for_cuda(case):
    """Exported from this CPU host on jax 0.10.2 and 0.11.2 alike (no CUDA plugin, no
    abstract device needed). Never run on a GPU: lowering is all this proves."""
    _, key, t, s = case
    fn = functools.partial(ragged_paged_attention_mosaic_gpu, sm_scale=key[0] ** -0.5,
                           sliding_window=key[5], soft_cap=30.0 if key[5] else None)
    refused = _mosaic_gpu_refuses(key)
    if refused:
        with pytest.raises(ValueError, match=f"does not support {refused}"):
            export.export(jax.jit(fn), platforms=["cuda"])(*_args(key, t, s))
        return
    exp = export.export(jax.jit(fn), platforms=["cuda"])(*_args(key, t, s))
    text = exp.mlir_module()
    assert MOSAIC_GPU_CALL in text, "no Mosaic GPU kernel in the lowered module"
    assert "nvvm.wgmma" in text and "nvvm.cp.async.bulk.tensor" in text, "no wgmma / TMA ops"
    assert exp.out_avals[0].shape == (t, key[3], key[0])


@pytest.mark.parametrize("bucket", [0, -1], ids=["decode", "prefill"])
def test_mosaic_gpu_lowers_with_sinks(bucket):
    """gpt-oss's attention sinks (the only preset with them) at its shape."""
    c = load_config("gpt_oss_120b")
    assert c.model.attention.sinks
    key = next(k for k, name in _preset_shapes().items() if name == "gpt_oss_120b")
    t, s = _buckets("gpt_oss_120b")[bucket]
    fn = functools.partial(ragged_paged_attention_mosaic_gpu, sm_scale=key[0] ** -0.5,
                           sliding_window=key[5])
    sinks = jax.ShapeDtypeStruct((key[3],), jnp.float32)
    exp = export.export(jax.jit(fn), platforms=["cuda"])(*_args(key, t, s), sinks=sinks)
    assert MOSAIC_GPU_CALL in exp.mlir_module()


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_mosaic_gpu_lowers_with_quantized_pages(head_dim, kv_dtype):
    """int8 / fp8 pages (dequantized into a bf16 SMEM operand per KV block) at each
    lowered head_dim, GQA 4, the engine's smallest bucket (16 tokens x 16 sequences)."""
    key = (head_dim, "bfloat16", 16, 4, 1, None)
    q, kv, *meta = _args(key, 16, 16)
    kv = jax.ShapeDtypeStruct(kv.shape, jnp.dtype(kv_dtype))
    scales = jax.ShapeDtypeStruct(kv.shape[:3], jnp.float32)
    fn = functools.partial(ragged_paged_attention_mosaic_gpu, sm_scale=head_dim ** -0.5)
    exp = export.export(jax.jit(fn), platforms=["cuda"])(q, kv, *meta, kv_scales=scales)
    assert MOSAIC_GPU_CALL in exp.mlir_module()


def test_mosaic_gpu_lowers_most_bf16_preset_shapes():
    """The refusals stay the exception: every bf16 preset shape with head_dim 64/96/128/256
    and a group up to 64 lowers (test_mosaic_gpu_lowers_for_cuda), and those are most."""
    keys = set(_preset_shapes())
    lowered = {k for k in keys if not _mosaic_gpu_refuses(k)}
    assert {k[0] for k in lowered} == {64, 96, 128, 256}
    assert {k[3] for k in lowered} >= {1, 2, 4, 7, 8}
    assert len(lowered) >= len(keys) // 2


def test_the_cases_cover_every_preset_shape():
    """A new preset with a new head shape or dtype is lowered too, not silently skipped."""
    covered = {key for _, key, _, _ in CASES}
    assert covered == set(_preset_shapes())
    assert {k[1] for k in covered} >= {"float32", "bfloat16"} and {k[0] for k in covered} >= {32, 64, 128}


@pytest.mark.parametrize("preset", ["mixtral_8x7b", "qwen3_30b_a3b", "gpt_oss_120b"])
def test_pallas_tpu_grouped_matmul_lowers_with_mosaic(preset):
    """The MoE grouped matmul's two projections at a preset's expert shapes (a 2048-token
    prefill at top k), bf16."""
    from jaxfill.pallas_kernels.grouped_matmul_tpu import grouped_matmul_tpu

    m = load_config(preset).model
    rows, h, i = 2048 * m.moe.experts_per_token, m.hidden_size, m.moe.intermediate_size
    for k, n in ((h, 2 * i), (i, h)):
        args = (jax.ShapeDtypeStruct((rows, k), jnp.bfloat16),
                jax.ShapeDtypeStruct((m.moe.num_experts, k, n), jnp.bfloat16),
                jax.ShapeDtypeStruct((m.moe.num_experts,), jnp.int32))
        exp = export.export(jax.jit(functools.partial(grouped_matmul_tpu, interpret=False)), platforms=["tpu"])(*args)
        assert "tpu_custom_call" in exp.mlir_module()
