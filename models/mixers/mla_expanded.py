"""Multi-head latent attention's expanded form, for long prefill chunks.

The absorbed form (models/mixers/mla.py) attends over the latent itself: every (query, key) pair
costs a score and a value product of width kv_lora_rank + qk_rope_head_dim (576 for
DeepSeek V3), and each query is projected into latent space. The expanded form first
expands each cached latent into per-head K = [W_uk c, k_pe] and V = W_uv c (width
qk_nope + qk_rope = 192 and v_head_dim = 128 for V3), then runs ordinary multi-head
attention: a pair costs 2 x 192 instead of 2 x 576, but every key the batch touches is
multiplied by kv_b_proj once. Long chunks (many queries per key) win; decode (one query
per key) loses by two orders of magnitude. `prefers_expanded` makes that call per step
from the batch's real lengths (a `lax.cond`, both forms compiled into one program).

The expansion gathers the pages the batch's sequences touch into a compact page table of
`cap` pages (static), expands them, and calls the same ragged paged attention with the
per-head layout [cap, page_size, 2 * H, D]. A batch touching more pages than `cap` stays
absorbed."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfill.pallas_kernels import ragged_paged_attention
from jaxfill.pallas_kernels.kv_cache import merge_kv
from jaxfill.pallas_kernels.kv_quant import QuantizedPages, dequantize

# "auto" expands at most this many cached keys per token of the step (a static workspace:
# cap pages of [page_size, 2 * H, D] per layer on each device).
EXPAND_KEYS_PER_TOKEN = 8


def touched_pages(kv_lens: jax.Array,  # [S] int32
                  num_seqs: jax.Array,  # [1] int32
                  page_size: int) -> jax.Array:  # [S] int32: pages each live sequence reads
    live = jnp.arange(kv_lens.shape[0]) < num_seqs[0]
    return jnp.where(live, -(-jnp.maximum(kv_lens, 0) // page_size), 0).astype(jnp.int32)


def compact_page_table(page_indices: jax.Array,  # [S, P] int32
                       pages_per_seq: jax.Array,  # [S] int32 (touched_pages)
                       cap: int) -> tuple[jax.Array, jax.Array]:  # src [cap], table [S, P]
    """Sequence s's j-th page goes to compact slot offsets[s] + j: `src` names the cache
    page behind each compact slot, `table` is the page table over the compact pages."""
    s, p = page_indices.shape
    ends = jnp.cumsum(pages_per_seq)
    offsets = ends - pages_per_seq
    table = jnp.clip(offsets[:, None] + jnp.arange(p)[None, :], 0, cap - 1).astype(jnp.int32)
    slot = jnp.arange(cap)
    owner = jnp.clip(jnp.searchsorted(ends, slot, side="right"), 0, s - 1)
    j = jnp.clip(slot - offsets[owner], 0, p - 1)
    return page_indices[owner, j].astype(jnp.int32), table


def expand_pages(pages,  # [N, page_size, 1, lat + rope (+ indexer key)] array or QuantizedPages (K-only)
                 src: jax.Array,  # [cap] int32
                 w_uk: jax.Array,  # [H, lat, nope]
                 w_uv: jax.Array,  # [H, lat, vd]
                 dtype, rope: int) -> jax.Array:  # [cap, page_size, 2 * H, max(nope + rope, vd)]
    lat = w_uk.shape[1]
    if isinstance(pages, QuantizedPages):
        entries = dequantize(pages.values[src], pages.scales[src], dtype)
    else:
        entries = pages[src].astype(dtype)
    entries = entries[:, :, 0, :lat + rope]  # [cap, ps, lat + rope]: not a sparse-attention indexer's key
    c, pe = entries[..., :lat], entries[..., lat:]
    heads = w_uk.shape[0]
    k_nope = jnp.einsum("pkc,hcn->pkhn", c, w_uk.astype(dtype))
    k = jnp.concatenate([k_nope, jnp.broadcast_to(pe[:, :, None, :], k_nope.shape[:3] + pe.shape[-1:])], -1)
    v = jnp.einsum("pkc,hcv->pkhv", c, w_uv.astype(dtype))
    width = max(k.shape[-1], v.shape[-1])
    k = jnp.pad(k, [(0, 0)] * 3 + [(0, width - k.shape[-1])])
    v = jnp.pad(v, [(0, 0)] * 3 + [(0, width - v.shape[-1])])
    n, ps = k.shape[:2]
    return merge_kv(k.reshape(n * ps, heads, width), v.reshape(n * ps, heads, width)).reshape(n, ps, 2 * heads, width)


def prefers_expanded(meta, page_size: int, cap: int, *, lat: int, rope: int, nope: int, vd: int) -> jax.Array:
    """True when the batch fits `cap` expanded pages and the expanded form costs fewer
    multiply-adds per head: absorbed pays 2 (lat + rope) per (query, key) pair plus
    lat (nope + vd) per query; expanded pays 2 max(nope + rope, vd) per pair plus
    lat (nope + vd) per touched key."""
    s = meta.kv_lens.shape[0]
    live = jnp.arange(s) < meta.num_seqs[0]
    q_lens = jnp.where(live, jnp.diff(meta.cu_q_lens)[:s], 0).astype(jnp.float32)
    kv_lens = jnp.where(live, meta.kv_lens, 0).astype(jnp.float32)
    pairs = jnp.sum(q_lens * (kv_lens - (q_lens - 1) / 2))
    pages = jnp.sum(touched_pages(meta.kv_lens, meta.num_seqs, page_size))
    up = lat * (nope + vd)
    absorbed = pairs * 2 * (lat + rope) + jnp.sum(q_lens) * up
    expanded = pairs * 2 * max(nope + rope, vd) + pages.astype(jnp.float32) * page_size * up
    return (pages <= cap) & (expanded < absorbed)


def expanded_attention(q: jax.Array,  # [T, H, nope + rope], the rope part roped
                       pages,  # K-only latent pages [N, page_size, 1, lat + rope] (or QuantizedPages)
                       meta,
                       w_uk: jax.Array,  # [H, lat, nope]
                       w_uv: jax.Array,  # [H, lat, vd]
                       *, cap: int, sm_scale: float, impl: str) -> jax.Array:  # [T, H, vd]
    page_size = (pages.values if isinstance(pages, QuantizedPages) else pages).shape[1]
    per_seq = touched_pages(meta.kv_lens, meta.num_seqs, page_size)
    src, table = compact_page_table(meta.page_indices, per_seq, cap)
    rope = q.shape[-1] - w_uk.shape[-1]
    expanded = expand_pages(pages, src, w_uk, w_uv, q.dtype, rope)  # [cap, ps, 2H, width]
    width = expanded.shape[-1]
    qe = jnp.pad(q, ((0, 0), (0, 0), (0, width - q.shape[-1])))
    out = ragged_paged_attention(qe, expanded, meta.kv_lens, table, meta.cu_q_lens, meta.num_seqs,
                                 sm_scale=sm_scale, impl=impl)
    return out[..., :w_uv.shape[-1]]
