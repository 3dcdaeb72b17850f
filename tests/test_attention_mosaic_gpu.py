"""The Mosaic GPU kernel (impl="mosaic_gpu") against the float64 oracle, in Mosaic GPU's
CPU interpreter, and what it refuses by name.

Interpreted, the kernel runs its real control flow, TMA page gathers into the two-slot
ring, barriers (race detector on, none found), masks, online softmax and the per-block
sum of items; only its two
matmuls are plain dots there (the interpreter's wgmma takes no transposed or register
operand). The wgmma path itself is only lowered here (test_kernel_lowering.py); the
"compiled" cases run it on a Hopper GPU and skip anywhere else: they have never run.
All cases bf16 (the kernel refuses f32), page_size 8 or 16, NaN garbage.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_cast_orders import bf16_mismatch, cast_order, wrong_orders
from attention_oracle import make_batch, oracle, rel_err
from jaxfill.pallas_kernels import ragged_paged_attention, resolve_impl
from jaxfill.pallas_kernels.ragged_paged_attention.mosaic_gpu import (
    races_found, ragged_paged_attention_mosaic_gpu)

TOL = 8e-3  # max |out - ref| / max |ref| against the exact oracle (as for every bf16 impl)
BF16_MISMATCH_TOL = 1.5e-2  # against the oracle with the kernel's cast order (test_attention_oracle)

# name: (seqs [(q_len, kv_len)], hq, hkv, d, page_size, window, cap, extra padding tokens, sinks,
#        KV page dtype (None: bf16))
CASES = {
    # Two sequences share query blocks (block_q = 64 / 4 = 16 tokens): items sum per block.
    "mixed_gqa4_straddling": ([(5, 20), (1, 70), (0, 3), (9, 9)], 4, 1, 64, 16, None, None, 1, False, None),
    # One KV block per sequence and several (300 keys: 5 blocks, the ring wraps twice).
    "multi_block_decode_gqa8": ([(1, 300), (1, 64), (1, 65), (1, 1)], 8, 1, 128, 8, None, None, 2, False, None),
    "prefill_mha_window_cap": ([(40, 100), (3, 3)], 2, 2, 64, 16, 37, 20.0, 5, False, None),
    # gpt-oss: sinks with a window, GQA 8 (its shape family); Phi-3's head_dim 96 (64-byte swizzle).
    "sinks_window_gqa8": ([(7, 90), (1, 33)], 8, 1, 64, 16, 40, None, 1, True, None),
    # Prefill-sized: tiles of 2 of the 4 heads x 32 tokens (two tiles per KV head), sinks.
    "prefill_split_heads_sinks": ([(40, 60), (30, 30), (1, 5)], 8, 2, 64, 16, None, None, 1, True, None),
    # Quantized pages: NaN scales (fp8: NaN values too) wherever no sequence owns a slot.
    "int8_multi_block": ([(3, 150), (1, 20), (2, 2)], 4, 2, 64, 16, None, None, 1, False, "int8"),
    "fp8_window": ([(20, 80), (1, 9)], 2, 1, 128, 8, 50, None, 2, False, "float8_e4m3fn"),
    "head_dim_96": ([(6, 70), (1, 12)], 2, 1, 96, 16, None, None, 1, False, None),
}


def _on_hopper() -> bool:
    return jax.default_backend() == "gpu" and any(
        getattr(d, "compute_capability", "") == "9.0" for d in jax.devices())  # wgmma: sm_90 only


# "compiled" is the check benchmarks/gpu_kernels.sh exists for: the real wgmma kernel on
# an H100/H200 against the same oracle. It has never run (no GPU was ever lent).
MODES = ["interpret", pytest.param("compiled", marks=pytest.mark.skipif(
    not _on_hopper(), reason="needs a Hopper (sm_90) GPU; mosaic_gpu has never run on one"))]


def _run(batch, sinks=None, interpret=True, **kw):
    args = [jnp.asarray(a) for a in batch.args()]
    sinks = None if sinks is None else jnp.asarray(sinks)
    scales = None if batch.kv_scales is None else jnp.asarray(batch.kv_scales)
    out = ragged_paged_attention_mosaic_gpu(*args, interpret=interpret, sinks=sinks, kv_scales=scales, **kw)
    return np.asarray(out.astype(jnp.float32))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_the_oracle(case, mode):
    seqs, hq, hkv, d, ps, window, cap, pad, with_sinks, kv_dtype = CASES[case]
    batch = make_batch(seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=ps,
                       dtype=jnp.bfloat16, num_tokens=sum(q for q, _ in seqs) + pad,
                       num_slots=len(seqs) + 1, seed=len(case), kv_dtype=kv_dtype)
    kw = dict(sm_scale=d ** -0.5, sliding_window=window, soft_cap=cap)
    # Sinks around the scores' scale (some rows dominated by the sink, some not).
    sinks = np.random.default_rng(1).normal(0.0, 2.0, hq).astype(np.float32) if with_sinks else None
    out = _run(batch, sinks=sinks, interpret=mode == "interpret", **kw)
    kw.update(sinks=sinks, kv_scales=batch.kv_scales)
    ref, live = oracle(*batch.args(), **kw)
    if mode == "interpret":
        assert not races_found(), "the interpreter's race detector fired"
    assert np.isfinite(out).all(), "NaN garbage reached an output row"
    assert not out[~live].any(), "padding rows must be zero"
    assert rel_err(out, ref, live) <= TOL
    # Rounded where the kernel rounds (q pre-scaled in f32, P per 64-key block): nearly
    # every element equal, and each plausible wrong cast order clearly farther.
    order = cast_order("mosaic_gpu", batch, sm_scale=kw["sm_scale"], soft_cap=cap)
    exact, _ = oracle(*batch.args(), **kw, cast=order)
    rate, ulps = bf16_mismatch(out, exact, live)
    assert rate <= BF16_MISMATCH_TOL, (rate, ulps)
    for name, wrong in wrong_orders(order, sm_scale=kw["sm_scale"]).items():
        bad, _ = oracle(*batch.args(), **kw, cast=wrong)
        if not np.array_equal(bad[live], exact[live]):
            assert bf16_mismatch(out, bad, live)[0] > 3 * BF16_MISMATCH_TOL, name


@pytest.mark.parametrize("backend", ["cpu", "gpu", "tpu"])
def test_auto_never_picks_it(backend, monkeypatch):
    """Never run on a GPU: served only when asked for by name."""
    assert resolve_impl("mosaic_gpu") == "mosaic_gpu"
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    assert resolve_impl("auto") != "mosaic_gpu"


@pytest.mark.parametrize("what, kw, match", [
    ("f32", dict(dtype=np.float32), "q dtype float32"),
    ("head_dim_80", dict(head_dim=80), "head_dim 80"),
    ("head_dim_576", dict(head_dim=576), "head_dim 576"),
    ("page_size_4", dict(page_size=4), "page_size 4"),
    ("group_128", dict(num_q_heads=128), "query group 128"),
])
def test_refuses_by_name(what, kw, match):
    shape = dict(num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=16, dtype=jnp.bfloat16)
    shape.update(kw)
    batch = make_batch([(3, 5)], **shape)
    with pytest.raises(ValueError, match=f"mosaic_gpu .* does not support {match}"):
        scales = None if batch.kv_scales is None else jnp.asarray(batch.kv_scales)
        ragged_paged_attention(*[jnp.asarray(a) for a in batch.args()], sm_scale=0.1,
                               impl="mosaic_gpu", kv_scales=scales)


def test_refuses_shared_pages_by_name():
    batch = make_batch([(3, 5)], num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=16,
                       dtype=jnp.bfloat16)
    args = [jnp.asarray(a) for a in batch.args()]
    shared = args[1][:, :, :1]  # [.., Hkv=1, D]: K only
    with pytest.raises(ValueError, match="does not support shared K/V pages"):
        ragged_paged_attention(args[0], shared, *args[2:], sm_scale=0.1, impl="mosaic_gpu",
                               kv_shared=True)
