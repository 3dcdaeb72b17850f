"""Quantized KV pages (int8, float8_e4m3fn): one scale per (token, combined head).

A quantized layer is two arrays with the same page layout: `pages[num_pages, page_size,
2 * Hkv, D]` in int8 / float8_e4m3fn and `scales[num_pages, page_size, 2 * Hkv]` float32,
K and V of head h at combined index 2h and 2h + 1 in both. One page id addresses both, a
shard of the combined-head axis carries its own scales, and a kernel fetches a KV block's
scales with the same page ids it fetches the block with.

Quantization is symmetric per token-head absmax: `scale = absmax / QMAX` (QMAX 127 for
int8, 448 for e4m3, its largest finite value), stored `round(x / scale)` (int8 rounds to
nearest and clips to [-127, 127]; fp8 rounds by the cast). A zero row gets scale 1. A
kernel sees `stored * scale` (f32), then casts to its compute dtype: `dequantize`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfill.pallas_kernels.kv_cache import merge_kv, scatter_indices

QUANT_DTYPES = {"int8": jnp.int8, "float8_e4m3fn": jnp.float8_e4m3fn}
QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}
SCALE_DTYPE = jnp.float32


def is_quantized(dtype) -> bool:
    return jnp.dtype(dtype) in QMAX


def init_kv_scales(num_pages: int, page_size: int, num_kv_heads: int,
                   fill_value: float = 1.0) -> jax.Array:  # [num_pages, page_size, 2 * Hkv]
    """One layer's scales, laid out like its pages minus head_dim."""
    if min(num_pages, page_size, num_kv_heads) <= 0:
        raise ValueError(f"init_kv_scales needs positive sizes, got num_pages={num_pages}, "
                         f"page_size={page_size}, num_kv_heads={num_kv_heads}")
    return jnp.full((num_pages, page_size, 2 * num_kv_heads), fill_value, SCALE_DTYPE)


def quantize(x: jax.Array,  # [..., D] float
             dtype,
             ) -> tuple[jax.Array, jax.Array]:  # stored [..., D] dtype, scale [...] f32
    qmax = QMAX[jnp.dtype(dtype)]
    xf = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(xf), axis=-1)
    scale = jnp.where(absmax > 0, absmax / qmax, 1.0).astype(SCALE_DTYPE)
    y = xf / scale[..., None]
    if jnp.issubdtype(jnp.dtype(dtype), jnp.integer):
        y = jnp.clip(jnp.round(y), -qmax, qmax)
    else:
        y = jnp.clip(y, -qmax, qmax)  # absmax / scale can round a hair past QMAX
    return y.astype(dtype), scale


def dequantize(stored: jax.Array,  # [..., D] int8 / fp8 (or float: passed through)
               scale: jax.Array | None,  # [...] f32, or None for unquantized pages
               dtype,
               ) -> jax.Array:  # [..., D] dtype
    """What every kernel computes with: stored * scale in f32, cast to `dtype`."""
    if scale is None:
        return stored.astype(dtype)
    return (stored.astype(jnp.float32) * scale[..., None].astype(jnp.float32)).astype(dtype)


def write_kv_quantized(pages: jax.Array,  # [num_pages, page_size, 2 * Hkv, D] int8 / fp8
                       scales: jax.Array,  # [num_pages, page_size, 2 * Hkv] f32
                       k: jax.Array,  # [T, Hkv, D]
                       v: jax.Array,  # [T, Hkv, D]
                       slot_mapping: jax.Array,  # [T] int32; < 0 skips
                       ) -> tuple[jax.Array, jax.Array]:  # pages, scales; donate both
    """`write_kv` for quantized pages: quantizes each token-head and scatters values and
    scales to the same slot (same unique, padding-past-the-end indices)."""
    num_pages, page_size, combined, head_dim = pages.shape
    if not is_quantized(pages.dtype):
        raise ValueError(f"write_kv_quantized: pages must be int8 or float8_e4m3fn, got {pages.dtype}")
    if scales.shape != pages.shape[:3]:
        raise ValueError(f"write_kv_quantized: scales {scales.shape} must be {pages.shape[:3]}")
    if k.shape != v.shape or k.ndim != 3 or 2 * k.shape[1] != combined or k.shape[2] != head_dim:
        raise ValueError(f"write_kv_quantized: k {k.shape} and v {v.shape} must be "
                         f"[T, {combined // 2}, {head_dim}] for pages {pages.shape}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"write_kv_quantized: slot_mapping {slot_mapping.shape} must be [{k.shape[0]}]")
    total = num_pages * page_size
    stored, scale = quantize(merge_kv(k, v), pages.dtype)  # [T, 2Hkv, D], [T, 2Hkv]
    idx = scatter_indices(slot_mapping, total)
    flat = pages.reshape(total, combined, head_dim)
    flat = flat.at[idx].set(stored, mode="drop", unique_indices=True)
    sflat = scales.reshape(total, combined)
    sflat = sflat.at[idx].set(scale.astype(scales.dtype), mode="drop", unique_indices=True)
    return flat.reshape(pages.shape), sflat.reshape(scales.shape)
