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

A quantized layer travels as one `QuantizedPages` pytree wherever an unquantized layer
travels as one array: `write_kv` and `ragged_paged_attention` take either, so model code
and the per-layer cache tuple are the same for every dtype.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

QUANT_DTYPES = {"int8": jnp.int8, "float8_e4m3fn": jnp.float8_e4m3fn}
QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}
SCALE_DTYPE = jnp.float32


def is_quantized(dtype) -> bool:
    return jnp.dtype(dtype) in QMAX


def init_kv_scales(num_pages: int, page_size: int, num_kv_heads: int,
                   fill_value: float = 1.0, shared: bool = False) -> jax.Array:  # [num_pages, page_size, 2 * Hkv]
    """One layer's scales, laid out like its pages minus head_dim."""
    if min(num_pages, page_size, num_kv_heads) <= 0:
        raise ValueError(f"init_kv_scales needs positive sizes, got num_pages={num_pages}, "
                         f"page_size={page_size}, num_kv_heads={num_kv_heads}")
    return jnp.full((num_pages, page_size, num_kv_heads if shared else 2 * num_kv_heads), fill_value, SCALE_DTYPE)


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedPages:
    """One quantized layer: values and their scales, addressed by the same page ids."""

    values: jax.Array  # [num_pages, page_size, 2 * Hkv, D] int8 / float8_e4m3fn
    scales: jax.Array  # [num_pages, page_size, 2 * Hkv] f32

    @property
    def shape(self) -> tuple[int, ...]:  # the values' shape, as for an unquantized layer
        return self.values.shape

    @property
    def dtype(self):
        return self.values.dtype


def init_quantized_pages(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                         dtype, fill_value: float = 0.0, shared: bool = False) -> QuantizedPages:
    """One quantized layer. A NaN fill leaves the values 0 (int8 has no NaN) and makes
    the scales NaN, so any read of an unwritten slot still turns into NaN."""
    if not is_quantized(dtype):
        raise ValueError(f"quantized KV pages must be int8 or float8_e4m3fn, got {dtype}")
    scales = init_kv_scales(num_pages, page_size, num_kv_heads,
                            fill_value if fill_value != fill_value else 1.0, shared)
    values = jnp.zeros(scales.shape + (head_dim,), dtype)
    return QuantizedPages(values, scales)
