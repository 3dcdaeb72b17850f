"""Quantized KV cache (engine.kv_cache_dtype = int8 / float8_e4m3fn).

Kernels: every impl on int8 and fp8 pages equals the quantization-aware float64 oracle
(attention_oracle.dequantized: stored * scale as the kernel sees it), with garbage in
unused pages and NaN in unused scales. Write: write_kv_quantized stores what the oracle's
NumPy quantizer would, scales beside the values at the same slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_oracle import make_batch, oracle, quantize_np, rel_err
from jaxfill.pallas_kernels import ragged_paged_attention
from jaxfill.pallas_kernels.kv_cache import write_kv_quantized
from jaxfill.pallas_kernels.kv_quant import init_kv_scales

KV_DTYPES = ["int8", "float8_e4m3fn"]
IMPLS = ["reference", "xla", "pallas_tpu", "pallas_gpu"]
TOL = {np.float32: 1e-5, jnp.bfloat16: 8e-3}  # as unquantized pages against the exact oracle

# (seqs, num_q_heads, num_kv_heads, head_dim, page_size, sliding_window, soft_cap, T, S)
CASES = {
    "mixed": ([(1, 9), (7, 20), (0, 0), (6, 13), (1, 1)], 4, 2, 64, 4, None, None, 16, 6),
    "window_cap": ([(5, 17), (1, 12)], 8, 2, 64, 4, 6, 20.0, 8, 3),
}


# The interpreted Pallas kernels are slow on CPU: they run the mixed f32 case only.
IMPL_CASES = [(impl, case, dtype) for impl in IMPLS for case in sorted(CASES)
              for dtype in (np.float32, jnp.bfloat16)
              if impl not in ("pallas_tpu", "pallas_gpu") or (case == "mixed" and dtype == np.float32)]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("impl,case,dtype", IMPL_CASES,
                         ids=[f"{i}-{c}-{'f32' if d == np.float32 else 'bf16'}" for i, c, d in IMPL_CASES])
def test_impl_matches_quantized_oracle(impl, kv_dtype, case, dtype):
    """bf16: the kernel dequantizes to bf16 operands; the oracle rounds the same way."""
    seqs, hq, hkv, d, ps, window, cap, t, s = CASES[case]
    batch = make_batch(seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=ps,
                       num_tokens=t, num_slots=s, seed=3, kv_dtype=kv_dtype, dtype=dtype)
    assert np.isnan(batch.kv_scales).any(), "unused scales must be NaN"
    kw = dict(sm_scale=d ** -0.5, sliding_window=window, soft_cap=cap)
    ref, live = oracle(*batch.args(), **kw, kv_scales=batch.kv_scales)
    args = [jnp.asarray(a) for a in batch.args()]
    out = np.asarray(ragged_paged_attention(*args, **kw, impl=impl,
                                            kv_scales=jnp.asarray(batch.kv_scales)).astype(jnp.float32))
    assert np.isfinite(out).all(), "NaN from an unused page or scale reached an output"
    assert rel_err(out, ref, live) <= TOL[dtype]
    # The quantization is real: the oracle of the unquantized K/V is measurably elsewhere.
    if dtype == np.float32:
        raw = make_batch(seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=ps,
                         num_tokens=t, num_slots=s, seed=3)
        exact, _ = oracle(*raw.args(), **kw)
        assert rel_err(out, exact, live) > 100 * TOL[dtype]


def test_scales_must_come_with_quantized_pages():
    batch = make_batch([(2, 5)], num_q_heads=2, num_kv_heads=1, head_dim=8, page_size=4,
                       kv_dtype="int8")
    args = [jnp.asarray(a) for a in batch.args()]
    with pytest.raises(ValueError, match="kv_scales must be given"):
        ragged_paged_attention(*args, sm_scale=1.0)
    with pytest.raises(ValueError, match="kv_scales must be"):
        ragged_paged_attention(*args, sm_scale=1.0, kv_scales=jnp.ones((2, 4, 2)))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_write_kv_quantized_stores_values_and_scales_at_the_slot(kv_dtype):
    num_pages, page_size, hkv, d = 5, 4, 2, 16
    dtype = {"int8": jnp.int8, "float8_e4m3fn": jnp.float8_e4m3fn}[kv_dtype]
    pages = jnp.zeros((num_pages, page_size, 2 * hkv, d), dtype)
    scales = init_kv_scales(num_pages, page_size, hkv, fill_value=float("nan"))
    rng = np.random.default_rng(0)
    k = (3 * rng.standard_normal((6, hkv, d))).astype(np.float32)
    v = rng.standard_normal((6, hkv, d)).astype(np.float32)
    k[2] = 0.0  # a zero token-head: scale 1, values 0
    slots = np.array([5, 9, 0, -1, 19, 12], np.int32)
    fn = jax.jit(write_kv_quantized, donate_argnums=(0, 1))
    out, out_scales = fn(pages, scales, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
    out = np.asarray(out.astype(jnp.float32))
    out_scales = np.asarray(out_scales)
    written = np.zeros((num_pages, page_size), bool)
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        page, off = divmod(int(slot), page_size)
        written[page, off] = True
        for x, idx in ((k[t], slice(0, None, 2)), (v[t], slice(1, None, 2))):
            want, want_scale = quantize_np(x, kv_dtype)
            # XLA may divide by QMAX as a multiply by 1/QMAX: one ulp, then at most one step.
            np.testing.assert_allclose(out_scales[page, off, idx], want_scale, rtol=3e-7)
            np.testing.assert_allclose(out[page, off, idx], want.astype(np.float32),
                                       rtol=2 ** -3, atol=1.0 if kv_dtype == "int8" else 0)
            # Round trip: half an int8 step; e4m3 (3-bit mantissa): 2**-4 relative, and half
            # its smallest subnormal step (2**-9) near zero.
            sc = out_scales[page, off, idx][:, None]
            rt = out[page, off, idx] * sc
            bound = 0.5 * sc if kv_dtype == "int8" else 2 ** -4 * np.abs(x) + 2 ** -10 * sc
            assert np.all(np.abs(rt - x) <= bound * (1 + 1e-6))
    assert np.isnan(out_scales[~written]).all()
    assert (out[~written] == 0).all()
    np.testing.assert_array_equal(out_scales[0, 0, 0::2], 1.0)  # the zero K row


def test_write_kv_quantized_rejects_bad_input():
    pages = jnp.zeros((2, 4, 4, 8), jnp.int8)
    with pytest.raises(ValueError, match="scales"):
        write_kv_quantized(pages, jnp.ones((2, 4, 2)), jnp.ones((1, 2, 8)), jnp.ones((1, 2, 8)),
                           jnp.zeros(1, jnp.int32))
    with pytest.raises(ValueError, match="int8 or float8"):
        write_kv_quantized(pages.astype(jnp.float32), jnp.ones((2, 4, 4)), jnp.ones((1, 2, 8)),
                           jnp.ones((1, 2, 8)), jnp.zeros(1, jnp.int32))


# ----------------------------------------------------------------------- bytes
@pytest.mark.slow
def test_kv_bytes_per_token_agree_in_cache_planner_and_stats():
    """int8 / fp8 = one byte per value + one f32 scale per (token, K or V, head): for
    tiny_random (L layers, Hkv heads, D) 2*L*Hkv*(D + 4) vs 2*L*Hkv*D*itemsize, the same in
    KVCache.nbytes, the planner and Engine.stats."""
    from jaxfill.engine.config import load_config
    from jaxfill.engine.engine import Engine
    from jaxfill.engine.planner.counts import kv_bytes_per_token
    from jaxfill.models.kv_cache import KVCache

    overrides = {"engine.max_num_batched_tokens": 16, "engine.token_buckets": [16],
                 "engine.num_pages": 8, "engine.max_model_len": 64}
    m = load_config("tiny_random", overrides).model
    num_pages, page_size = 8, 16
    got = {}
    for kv_dtype in ["auto", *KV_DTYPES]:
        cache = KVCache.create(m, num_pages, page_size, kv_cache_dtype=kv_dtype)
        per_token = cache.nbytes() / (num_pages * page_size)
        value_bytes = 1 if kv_dtype != "auto" else jnp.dtype(m.jnp_dtype).itemsize
        scale_bytes = 4 if kv_dtype != "auto" else 0
        assert per_token == 2 * m.num_layers * m.num_kv_heads * (m.head_dim * value_bytes + scale_bytes)
        assert kv_bytes_per_token(m, kv_cache_dtype=kv_dtype) == per_token
        got[kv_dtype] = per_token
    assert got["int8"] == got["float8_e4m3fn"]
    # Against a bf16 cache: exactly half the values, plus the scales.
    bf16 = 2 * m.num_layers * m.num_kv_heads * m.head_dim * 2
    assert got["int8"] == bf16 / 2 + 2 * m.num_layers * m.num_kv_heads * 4
    eng = Engine.from_config("tiny_random", overrides={**overrides, "engine.kv_cache_dtype": "int8"},
                             progress=False)
    st = eng.stats()
    assert st["kv_cache_dtype"] == "int8"
    assert st["kv_bytes_per_token"] == got["int8"]
    # GetModelInfo tells a client the same bytes as the stats and the planner.
    from jaxfill.engine.planner.counts import weight_bytes
    from jaxfill.serving.client import Client
    from jaxfill.serving.server import ServerThread

    with ServerThread(eng, host="127.0.0.1", port=0) as server:
        assert server.wait_ready(600)
        info = Client(server.address).model_info()
    assert (info.kv_cache_dtype, info.kv_bytes_per_token) == ("int8", got["int8"])
    assert info.weight_dtype == "auto" and info.weight_bytes == st["weight_bytes"] == weight_bytes(m)
    assert st["kv_cache_bytes"] == got["int8"] * 8 * 16


def test_plan_reports_quantized_kv_and_twice_the_requests():
    """llama3_8b on h100_sxm at 2048 tokens: int8 KV costs (128 + 4) / 256 of bf16 per token
    and fits ~1.9x the requests."""
    from jaxfill.engine.config import load_config
    from jaxfill.engine.planner.hardware import load_hardware
    from jaxfill.engine.planner.plan import plan_prefill

    hw = load_hardware("h100_sxm")
    rows = {d: plan_prefill(load_config("llama3_8b", {"engine.kv_cache_dtype": d}), hw, 2048)
            for d in ("auto", "int8", "float8_e4m3fn")}
    bf16, q8 = rows["auto"], rows["int8"]
    assert bf16["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2 == 131072
    assert q8["kv_bytes_per_token"] == 2 * 32 * 8 * (128 + 4) == 67584
    assert rows["float8_e4m3fn"]["kv_bytes_per_token"] == q8["kv_bytes_per_token"]
    ratio = q8["max_concurrent_requests"] / bf16["max_concurrent_requests"]
    assert 1.9 <= ratio <= 2 * 128 / 132 + 0.01, ratio


def test_bad_kv_cache_dtype_is_refused():
    from jaxfill.engine.config import load_config
    from jaxfill.models.config import ConfigError

    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        load_config("tiny_random", {"engine.kv_cache_dtype": "int4"})


def scales_ignored(*args, kv_scales=None, **kw):  # reads int8 values as if the scale were 1
    from jaxfill.pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla

    return ragged_paged_attention_xla(*args, kv_scales=jnp.ones_like(kv_scales), **kw)


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_warmup_self_check_runs_the_quantized_path(kv_dtype, monkeypatch):
    from jaxfill.pallas_kernels import IMPLS
    from jaxfill.pallas_kernels.ragged_paged_attention.self_check import check_impl

    monkeypatch.setitem(IMPLS, "scales_ignored", ("test_kv_quant", "scales_ignored"))
    shape = dict(num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=8, kv_cache_dtype=kv_dtype)
    assert check_impl("reference", **shape) is None
    assert "relative error" in check_impl("scales_ignored", **shape)
