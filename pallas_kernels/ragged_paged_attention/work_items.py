"""The ragged batch cut into static work for the blocked impls (xla, pallas_tpu,
pallas_gpu, mosaic_gpu): the flat token array is cut into query blocks of `block_q` rows,
and since a block may hold the tail of one sequence and the head of the next, the unit of
work is an *item* = (query block, sequence): at most `num_blocks + S` of them, listed in
jnp from `cu_q_lens` (`work_items`). `item_bounds` gives one item's rows, positions and
the KV blocks it must read: nothing above the causal diagonal, nothing before the window.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxfill.pallas_kernels.ragged_paged_attention.window import window_start


def sanitize_cu_q_lens(cu_q_lens, num_seqs):
    """Entries past num_seqs (padding sequences) become the live total: empty sequences."""
    s1 = cu_q_lens.shape[0]
    n = num_seqs[0]
    total = cu_q_lens[n]
    return jnp.where(jnp.arange(s1, dtype=jnp.int32) <= n, cu_q_lens, total).astype(jnp.int32)


def work_items(cu_q_lens,  # [S+1] int32, sanitized
               num_seqs,  # [1] int32
               num_blocks: int,
               block_q: int):
    """(query block, sequence) pairs covering every live token once.

    Returns item_block[M], item_seq[M], num_items[] with M = num_blocks + S (static).
    Items past num_items repeat the last real one (harmless for consumers that check
    num_items; useful for grids that must not fetch out of range).
    """
    num_slots = cu_q_lens.shape[0] - 1
    total = cu_q_lens[num_seqs[0]]
    ends = cu_q_lens[1:]
    r0 = jnp.arange(num_blocks, dtype=jnp.int32) * block_q
    r1 = jnp.minimum(r0 + block_q, total) - 1
    active = r0 < total
    first = jnp.searchsorted(ends, r0, side="right").astype(jnp.int32)
    last = jnp.searchsorted(ends, jnp.maximum(r1, 0), side="right").astype(jnp.int32)
    first = jnp.minimum(first, num_slots - 1)
    last = jnp.minimum(last, num_slots - 1)
    count = jnp.where(active, last - first + 1, 0)
    incl = jnp.cumsum(count).astype(jnp.int32)
    num_items = incl[-1]
    m = num_blocks + num_slots
    i = jnp.minimum(jnp.arange(m, dtype=jnp.int32), jnp.maximum(num_items - 1, 0))
    blk = jnp.searchsorted(incl, i, side="right").astype(jnp.int32)
    blk = jnp.minimum(blk, num_blocks - 1)
    seq = first[blk] + i - (incl[blk] - count[blk])
    seq = jnp.clip(seq, 0, num_slots - 1)
    return blk, seq, num_items


def item_bounds(b, s, cu, kv_lens, block_q: int, block_kv: int, sliding_window, stripes=None,
                attention_chunk=None):
    """Rows, positions and KV block ranges of one item; all int32 scalars. Positions are
    the sequence's; KV blocks count this rank's keys (`stripes`, see stripes.py: the same
    thing without context parallelism). The window (sliding or chunked, window.py) starts
    later for later rows, so the first row's start bounds the loop and the last row's
    start is where the unmasked blocks begin."""
    count = (lambda x: jnp.maximum(x, 0)) if stripes is None else stripes.local_count
    q_start, q_end = cu[s], cu[s + 1]
    kv_len = kv_lens[s]
    ctx = kv_len - (q_end - q_start)  # position of the sequence's first new token
    r0 = b * block_q
    lo = jnp.maximum(r0, q_start)
    hi = jnp.minimum(r0 + block_q, q_end)
    empty = hi <= lo
    pmin = ctx + lo - q_start
    pmax = ctx + hi - 1 - q_start
    # lax.div on clamped non-negative operands: plain truncating division, which every
    # backend (XLA, Mosaic scalar core, Triton) lowers; `//` would add sign fix-ups.
    div = lambda x, y: lax.div(jnp.maximum(x, 0), jnp.int32(y))
    kv_hi = jnp.where(empty, 0, div(count(jnp.minimum(pmax + 1, kv_len)) + block_kv - 1, block_kv))
    first, last = (window_start(p, sliding_window, attention_chunk) for p in (pmin, pmax))
    if first is None:
        kv_lo = jnp.int32(0)
        a = jnp.int32(0)
    else:
        kv_lo = div(count(first), block_kv)
        # Blocks from `a` on hold only keys at or after the last row's start: visible to all rows.
        a = div(count(last) + block_kv - 1, block_kv)
    kv_lo = jnp.minimum(kv_lo, kv_hi)
    a = jnp.clip(a, kv_lo, kv_hi)
    c = jnp.clip(div(count(pmin + 1), block_kv), a, kv_hi)  # blocks before c end at or below pmin
    return dict(q_start=q_start, ctx=ctx, kv_len=kv_len, r0=r0, lo=lo, hi=hi,
                kv_lo=kv_lo, a=a, c=c, kv_hi=kv_hi)
