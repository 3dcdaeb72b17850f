"""The paged KV layout and its functional write.

One layer's cache is one array `pages[num_pages, page_size, 2 * Hkv, D]`. K and V of KV
head h sit side by side at combined-head index 2h and 2h+1. Interleaving keeps a head's
K and V in one block (one DMA per page on TPU, one shard per tensor-parallel rank) and
keeps the last two dims (heads, D) dense, which is what TPU tiling wants.

Shared pages (`kv_shared`, multi-head latent attention: models/mixers/mla.py): a head's value is
its key (the first dims of it), so the pages hold K only, `[num_pages, page_size, Hkv, D]`,
half the bytes; `write_kv(..., v=None)` writes them and the attention impls read V from
the K slot.

A token's slot is `page * page_size + offset`; a negative slot writes nothing, which is
how padding tokens are dropped without a branch.

The write is a scatter declared `unique_indices=True` (XLA may then skip serialising
colliding updates; with a collision the result is undefined on accelerators). So every
index must really be distinct: padding tokens (many of them per step) each get their own
out-of-range index, `total + t`, which `mode="drop"` discards. Real slots are distinct by
construction (the scheduler never gives two new tokens of one step the same slot:
tests/test_write_slots.py checks build_batch's output).

Quantized layers (`QuantizedPages`, see kv_quant.py) take the same write: each token-head
is quantized and its scale scattered to the same slot of the scales array.

bf16 pages on XLA:CPU are stored as their 16-bit words (uint16, `page_storage_dtype`).
XLA:CPU runs a bf16 scatter or gather in f32: it converts the whole pool to f32, scatters,
and converts it back, every layer of every step, and hoists the gather's convert of the
pool out of the attention loops; an integer scatter and gather update and read in place.
Measured on a 164 MB pool: one bf16 write 428 ms with 328 MB of temporaries, the same
write on uint16 words 0.017 ms with none (benchmarks/RESULTS.md, "bf16 KV pages on CPU").
That is jax 0.10.2's XLA:CPU; jax 0.11.2 scatters bf16 in place (528 bytes of
temporaries for both storages, tests/test_bf16_pages.py), where the words cost a free bitcast.
Readers take a block's values with `page_values` (a free bitcast of the block);
`write_kv` stores the words. Other backends keep bf16 pages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax import lax

from jaxfill.pallas_kernels.kv_quant import QuantizedPages, is_quantized, quantize

WORDS = jnp.dtype(jnp.uint16)  # bf16 pages as XLA:CPU stores them (module docstring)


def page_storage_dtype(dtype):
    """The dtype a pool of `dtype` values is stored in on this backend."""
    dtype = jnp.dtype(dtype)
    return WORDS if dtype == jnp.bfloat16 and jax.default_backend() == "cpu" else dtype


def page_values(pages: jax.Array) -> jax.Array:  # [..., D] stored pages (or a block) -> same, values
    """Stored words back to bf16 (a bitcast); any other pages as they are."""
    return lax.bitcast_convert_type(pages, jnp.bfloat16) if pages.dtype == WORDS else pages


def _stored(values: jax.Array, stored_dtype) -> jax.Array:  # [...] -> same, in the pages' storage
    if jnp.dtype(stored_dtype) == WORDS:
        return lax.bitcast_convert_type(values.astype(jnp.bfloat16), WORDS)
    return values.astype(stored_dtype)


def init_kv_pages(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                  dtype=jnp.float32, fill_value: float = 0.0, shared: bool = False) -> jax.Array:
    """Allocates one layer's pages: [num_pages, page_size, 2 * num_kv_heads, head_dim]
    ([.., num_kv_heads, ..] shared: K only)."""
    if min(num_pages, page_size, num_kv_heads, head_dim) <= 0:
        raise ValueError(
            f"init_kv_pages needs positive sizes, got num_pages={num_pages}, "
            f"page_size={page_size}, num_kv_heads={num_kv_heads}, head_dim={head_dim}"
        )
    shape = (num_pages, page_size, kv_slots(num_kv_heads, shared), head_dim)
    if jnp.dtype(dtype) == WORDS:  # bf16 stored as words: the fill's bf16 bit pattern
        return _stored(jnp.full(shape, fill_value, jnp.bfloat16), WORDS)
    return jnp.full(shape, fill_value, dtype)


def merge_kv(k: jax.Array,  # [T, Hkv, D]
             v: jax.Array,  # [T, Hkv, D]
             ) -> jax.Array:  # [T, 2 * Hkv, D]
    """Interleaves K and V heads: index 2h is K of head h, 2h + 1 is V of head h."""
    t, h, d = k.shape
    return jnp.stack([k, v], axis=2).reshape(t, 2 * h, d)


def split_kv(kv: jax.Array,  # [..., 2 * Hkv, D], or [..., Hkv, D] shared
             shared: bool = False) -> tuple[jax.Array, jax.Array]:  # K, V: [..., Hkv, D]
    return (kv, kv) if shared else (kv[..., 0::2, :], kv[..., 1::2, :])


def kv_slots(num_kv_heads: int, shared: bool = False) -> int:
    """Entries per token of a layer's pages: K and V per head, or K only (shared)."""
    return num_kv_heads if shared else 2 * num_kv_heads


def _entries(k, v):  # [T, 2 * Hkv, D] interleaved, or K alone for shared pages (v None)
    return k if v is None else merge_kv(k, v)


def write_kv(pages,  # [num_pages, page_size, 2 * Hkv, D] array, or QuantizedPages; [.., Hkv, D] shared
             k: jax.Array,  # [T, Hkv, D]
             v: jax.Array | None,  # [T, Hkv, D]; None: shared pages, K only
             slot_mapping: jax.Array,  # [T] int32, page * page_size + offset; < 0 skips
             ):  # pages, same shape and type; donate the input to update in place
    if isinstance(pages, QuantizedPages):
        return QuantizedPages(*write_kv_quantized(pages.values, pages.scales, k, v, slot_mapping))
    num_pages, page_size, combined, head_dim = pages.shape
    _check_entries("write_kv", pages.shape, k, v)
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"write_kv: slot_mapping {slot_mapping.shape} must be [{k.shape[0]}]")
    total = num_pages * page_size
    kv = _stored(_entries(k, v), pages.dtype)
    flat = pages.reshape(total, combined, head_dim)
    flat = flat.at[scatter_indices(slot_mapping, total)].set(kv, mode="drop", unique_indices=True)
    return flat.reshape(pages.shape)


def scatter_indices(slot_mapping: jax.Array,  # [T] int32; < 0 for padding
                    total: int,  # num_pages * page_size
                    ) -> jax.Array:  # [T] int32
    """Padding token t -> `total + t`: out of range (dropped) and distinct, as
    `unique_indices=True` requires; real slots pass through."""
    past_end = total + jnp.arange(slot_mapping.shape[0], dtype=slot_mapping.dtype)
    return jnp.where(slot_mapping < 0, past_end, slot_mapping)


def _check_entries(name: str, shape: tuple, k, v) -> None:
    combined, head_dim = shape[2], shape[3]
    want = kv_slots(k.shape[1] if k.ndim == 3 else 0, v is None)
    if k.ndim != 3 or (v is not None and v.shape != k.shape) or want != combined or k.shape[2] != head_dim:
        heads = combined if v is None else combined // 2
        raise ValueError(f"{name}: k {k.shape} and v {None if v is None else v.shape} must be "
                         f"[T, {heads}, {head_dim}] for pages {shape}")


def write_kv_quantized(pages: jax.Array,  # [num_pages, page_size, 2 * Hkv, D] int8 / fp8 ([.., Hkv, D] shared)
                       scales: jax.Array,  # [num_pages, page_size, 2 * Hkv] f32 ([.., Hkv] shared)
                       k: jax.Array,  # [T, Hkv, D]
                       v: jax.Array | None,  # [T, Hkv, D]; None: shared pages
                       slot_mapping: jax.Array,  # [T] int32; < 0 skips
                       ) -> tuple[jax.Array, jax.Array]:  # pages, scales; donate both
    """`write_kv` for quantized pages: quantizes each token-head and scatters values and
    scales to the same slot (same unique, padding-past-the-end indices)."""
    num_pages, page_size, combined, head_dim = pages.shape
    if not is_quantized(pages.dtype):
        raise ValueError(f"write_kv_quantized: pages must be int8 or float8_e4m3fn, got {pages.dtype}")
    if scales.shape != pages.shape[:3]:
        raise ValueError(f"write_kv_quantized: scales {scales.shape} must be {pages.shape[:3]}")
    _check_entries("write_kv_quantized", pages.shape, k, v)
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"write_kv_quantized: slot_mapping {slot_mapping.shape} must be [{k.shape[0]}]")
    total = num_pages * page_size
    stored, scale = quantize(_entries(k, v), pages.dtype)  # [T, slots, D], [T, slots]
    idx = scatter_indices(slot_mapping, total)
    flat = pages.reshape(total, combined, head_dim)
    flat = flat.at[idx].set(stored, mode="drop", unique_indices=True)
    sflat = scales.reshape(total, combined)
    sflat = sflat.at[idx].set(scale.astype(scales.dtype), mode="drop", unique_indices=True)
    return flat.reshape(pages.shape), sflat.reshape(scales.shape)
