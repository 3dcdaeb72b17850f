"""Blocked, flash-style ragged paged attention in pure JAX: the CPU default, GPU fallback.

Static shapes, ragged contents. The flat token array is cut into query blocks of
`block_q` rows. A block may hold the tail of one sequence and the head of the next, so
the unit of work is an *item* = (query block, sequence): at most `num_blocks + S` of them,
listed in jnp from `cu_q_lens` (`work_items`). For each item a `fori_loop` walks the KV
blocks of that sequence with dynamic bounds, so nothing above the causal diagonal (or
before the sliding window) is ever computed, not just masked:

    [kv_lo, a)    masked   (window edge: some keys too old for some rows)
    [a, c)        unmasked (every row of the item sees every key: no mask, no NaN guard)
    [c, kv_hi)    masked   (causal diagonal, and the partial last page; f32 with
                           block_q == block_kv: per row chunk, so most of the tile
                           above the diagonal is skipped too, see _attend)

The G query heads of one KV head are stacked into one [G*block_q, D] operand, so each
step is a batched matmul over KV heads. (`par` > 1 splits the heads into independent
loops; off by default, see block_sizes.xla_parallel_loops.)

Sequences with <= `short_q` new tokens (decodes) take a sequence-batched path instead:
one loop over KV blocks that serves all of them at once ([S, Hkv, G*short_q, D] x
[S, Hkv, block, D] per step), rather than one item, and one short loop, per sequence.
A pure decode batch runs only that path (`lax.cond`); a mixed batch (the engine's
chunked prefill next to decodes) runs both, the items skipping the decode sequences,
so a decode row never costs a whole block_q-row query block. Softmax runs in base 2 (log2(e) is folded into
q) with a polynomial exp2 that XLA CPU vectorizes well. K/V of masked blocks are zeroed
with `where` beyond kv_len, so NaN in unused page slots never reaches an output; rows of
an item that belong to another sequence, and padding rows, are dropped with `where`.
Quantized pages (int8 / fp8 with `kv_scales`) are dequantized per KV block as it is
loaded, to the compute dtype; the cache is never dequantized as a whole.
Attention sinks (gpt-oss, one logit per q head) only change the final normalisation:
acc / (l + 2**(sink - m)), in the scores' log2 units (`_normalize`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxfill.pallas_kernels.kv_cache import kv_slots, split_kv
from jaxfill.pallas_kernels.kv_quant import dequantize
from jaxfill.pallas_kernels.ragged_paged_attention.stripes import stripes
from jaxfill.pallas_kernels.ragged_paged_attention.block_sizes import (
    kv_block, xla_block_sizes, xla_diagonal_splits, xla_parallel_loops)

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
LOG2E = math.log2(math.e)


# --------------------------------------------------------------------------- metadata
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


def item_bounds(b, s, cu, kv_lens, block_q: int, block_kv: int, sliding_window, stripes=None):
    """Rows, positions and KV block ranges of one item; all int32 scalars. Positions are
    the sequence's; KV blocks count this rank's keys (`stripes`, see stripes.py: the same
    thing without context parallelism)."""
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
    if sliding_window is None:
        kv_lo = jnp.int32(0)
        a = jnp.int32(0)
    else:
        w = sliding_window
        kv_lo = div(count(pmin - w + 1), block_kv)
        # Blocks from `a` on have every key newer than pmax - W: visible to all rows.
        a = div(count(pmax - w + 1) + block_kv - 1, block_kv)
    kv_lo = jnp.minimum(kv_lo, kv_hi)
    a = jnp.clip(a, kv_lo, kv_hi)
    c = jnp.clip(div(count(pmin + 1), block_kv), a, kv_hi)  # blocks before c end at or below pmin
    return dict(q_start=q_start, ctx=ctx, kv_len=kv_len, r0=r0, lo=lo, hi=hi,
                kv_lo=kv_lo, a=a, c=c, kv_hi=kv_hi)


# --------------------------------------------------------------------------- math
def exp2(x):
    """2**x for x <= 0 in f32: round-to-nearest split + degree-6 polynomial.

    XLA CPU's generic exp goes through extra range handling; this one vectorizes to a
    round, a convert and six FMAs (relative error <= 1e-7 on [-125, 0], tested). Inputs
    below -126 give 2**-126. Do not write the round as (x + 1.5 * 2**23) - 1.5 * 2**23:
    XLA folds that to x.
    """
    x = jnp.maximum(x, -126.0)
    n = lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN)
    f = x - n  # [-0.5, 0.5]
    # Near-minimax (relative error) fit of 2**f on [-0.5, 0.5]: 1.9e-9 before rounding.
    p = jnp.float32(1.5345811606834423e-4)
    p = p * f + jnp.float32(1.3399931216301808e-3)
    p = p * f + jnp.float32(9.6184889585933350e-3)
    p = p * f + jnp.float32(5.5503287769744364e-2)
    p = p * f + jnp.float32(2.4022646890620264e-1)
    p = p * f + jnp.float32(6.9314720573726190e-1)
    p = p * f + jnp.float32(1.0000000005541690)
    scale = lax.bitcast_convert_type((n.astype(jnp.int32) + 127) << 23, jnp.float32)
    return p * scale


def _normalize(acc,  # [..., R, D'] f32
               l,  # [..., R] f32 softmax denominator so far
               m,  # [..., R] f32 running max (log2 units)
               sink):  # [Hkv', R] f32 sink logit of each row's head (log2 units), or None
    """The online softmax's output: acc over its denominator, plus the sink term when
    there are sinks. Rows that saw no key (l == 0) have acc == 0 and stay 0.

    The sink term uses jnp.exp2, not the polynomial `exp2`: sink - m may be positive
    (a sink above every score), outside the polynomial's range."""
    if sink is not None:
        return acc / jnp.where(l > 0, l + jnp.exp2(sink - m), 1.0)[..., None]
    return acc / jnp.where(l > 0, l, 1.0)[..., None]


def _lse(m,  # [..., R] f32 running max (log2 units)
         l):  # [..., R] f32 denominator
    """Natural-log log-sum-exp of a row's scores; -inf for a row that saw no key."""
    return jnp.where(l > 0, (m + jnp.log2(jnp.where(l > 0, l, 1.0))) / LOG2E, -jnp.inf)


# --------------------------------------------------------------------------- kernel
def _attend(q,  # [T_pad, Hkv', G', D] unscaled q, T_pad a multiple of bq; R = G' * bq
            kv_pages,  # [num_pages, page_size, 2 * Hkv', D]
            kv_scales,  # [num_pages, page_size, 2 * Hkv'] f32, or None (unquantized pages)
            sinks,  # [Hkv', G'] f32 attention sinks in log2 units, or None
            pidx,  # [S, P'] int32 page table padded to whole KV blocks, plus one block
            cu, kv_lens, item_block, item_seq, num_items,
            seq_skip,  # [S] bool: sequences another path serves (their items do nothing)
            *, q_scale, bq, bk, ppb, sliding_window, soft_cap, exp2_fn, sum_pad, diag_splits,
            kv_shared=False, stripes=None, want_lse=False):
    """One independent loop over all items for a subset of heads: out [T_pad, Hkv', G', D] f32,
    and with `want_lse` each row's log-sum-exp [T_pad, Hkv', G'] f32 (-inf: no key seen).

    Each item scales and stacks its own query block and writes its rows straight into
    token layout, so no [T, Hq, D]-sized pass runs before or after the loop.

    The masked tail [c, kv_hi) (causal diagonal) runs per row chunk: the item's rows are
    cut into `diag_splits` chunks of bq / diag_splits rows (in each of the G stacked
    heads), and chunk i walks keys from c * bk in windows of (i + 1) * bk / diag_splits
    keys, up to its own last row's position. With bq == bk and an aligned diagonal
    that is one window per chunk, (n + 1) / 2n of the full tile instead of all of it.
    """
    t_pad, num_kv_heads, group, head_dim = q.shape
    rows = group * bq
    combined = kv_slots(num_kv_heads, kv_shared)
    page_size = kv_pages.shape[1]
    cdt = q.dtype
    row_in_block = jnp.tile(jnp.arange(bq, dtype=jnp.int32), group)  # [R], g-major
    nsub = diag_splits
    bq_sub = bq // nsub
    # Each chunk's rows are g-major (G' heads x bq_sub rows): the sink of each row's head.
    sink_rows = None if sinks is None else jnp.repeat(sinks, bq_sub, axis=1)  # [Hkv', G'*bq_sub]

    def load_kv(s, page0, npages):
        ids = lax.dynamic_slice_in_dim(pidx[s], page0, npages)
        kv = kv_pages[ids].reshape(npages * page_size, combined, head_dim)
        if kv_scales is not None:
            kv = dequantize(kv, kv_scales[ids].reshape(npages * page_size, combined), cdt)
        k, v = (x.transpose(1, 0, 2) for x in split_kv(kv, kv_shared))  # [Hkv', keys, D]
        if sum_pad:  # ones columns: P @ [V | 1] also yields the row sums of P
            v = jnp.concatenate([v, jnp.ones(v.shape[:2] + (sum_pad,), v.dtype)], axis=-1)
        return k, v

    def scores_of(qb, k):
        sc = jnp.einsum("hrd,hkd->hrk", qb, k, preferred_element_type=jnp.float32)
        if soft_cap is not None:
            sc = (soft_cap * LOG2E) * jnp.tanh(sc / soft_cap)
        return sc

    def update(carry, sc, v):
        m, l, acc = carry
        m_new = jnp.maximum(m, sc.max(axis=-1))
        alpha = exp2_fn(m - m_new)
        p = exp2_fn(sc - m_new[..., None])
        if not sum_pad:
            l = alpha * l + p.sum(axis=-1)
        pv = jnp.einsum("hrk,hkd->hrd", p.astype(cdt), v, preferred_element_type=jnp.float32)
        return m_new, l, alpha[..., None] * acc + pv

    def masked_update(carry, s, qb, row_pos, key0, nkeys, key_end):
        """One masked step over keys [key0, key0 + nkeys); keys >= key_end are zeroed."""
        k, v = load_kv(s, key0 // page_size, nkeys // page_size)
        key_pos = stripes.to_global(key0 + jnp.arange(nkeys, dtype=jnp.int32))
        in_len = (key_pos < key_end)[None, :, None]
        k = jnp.where(in_len, k, jnp.zeros((), k.dtype))
        v = jnp.where(in_len, v, jnp.zeros((), v.dtype))
        sc = scores_of(qb, k)
        vis = (key_pos[None, :] <= row_pos[:, None]) & (key_pos[None, :] < key_end)
        if sliding_window is not None:
            vis &= key_pos[None, :] > row_pos[:, None] - sliding_window
        sc = jnp.where(vis[None], sc, MASK_VALUE)
        return update(carry, sc, v)

    def rows_of(x, chunk, axis):  # chunk `chunk`'s rows of x, whose R rows are at `axis`
        shape = x.shape
        y = x.reshape(shape[:axis] + (group, nsub, bq_sub) + shape[axis + 1:])
        y = lax.index_in_dim(y, chunk, axis + 1, keepdims=False)
        return y.reshape(shape[:axis] + (group * bq_sub,) + shape[axis + 1:])

    def one_item(i, outs_so_far):
        b, s = item_block[i], item_seq[i]
        ib = item_bounds(b, s, cu, kv_lens, bq, bk, sliding_window, stripes)
        skip = seq_skip[s]
        for edge in ("a", "c", "kv_hi"):  # a skipped item runs no KV block at all
            ib[edge] = jnp.where(skip, ib["kv_lo"], ib[edge])
        qb = lax.dynamic_slice_in_dim(q, b * bq, bq)  # [bq, Hkv', G', D]
        qb = (qb.astype(jnp.float32) * q_scale).astype(cdt)
        qb = qb.transpose(1, 2, 0, 3).reshape(num_kv_heads, rows, head_dim)  # [Hkv', R, D]
        row_tok = ib["r0"] + row_in_block  # flat token of each row
        row_pos = ib["ctx"] + row_tok - ib["q_start"]  # [R]

        def masked_step(j, carry):
            return masked_update(carry, s, qb, row_pos, j * bk, bk, ib["kv_len"])

        def full_step(j, carry):
            k, v = load_kv(s, j * ppb, ppb)
            return update(carry, scores_of(qb, k), v)

        carry = (jnp.full((num_kv_heads, rows), MASK_VALUE, jnp.float32),
                 jnp.zeros((num_kv_heads, rows), jnp.float32),
                 jnp.zeros((num_kv_heads, rows, head_dim + sum_pad), jnp.float32))
        carry = lax.fori_loop(ib["kv_lo"], ib["a"], masked_step, carry)
        carry = lax.fori_loop(ib["a"], ib["c"], full_step, carry)
        tail0 = ib["c"] * bk
        tail_len = (ib["kv_hi"] - ib["c"]) * bk
        outs, lses = [], []
        for chunk in range(nsub):  # static: each chunk has its own window width
            width = (chunk + 1) * (bk // nsub)
            c_hi = jnp.minimum(ib["r0"] + (chunk + 1) * bq_sub, ib["hi"])
            key_end = jnp.minimum(ib["ctx"] + c_hi - ib["q_start"], ib["kv_len"])
            need = jnp.clip(stripes.local_count(key_end) - tail0, 0, tail_len)
            steps = lax.div(need + width - 1, jnp.int32(width))
            q_c, pos_c = rows_of(qb, chunk, 1), rows_of(row_pos, chunk, 0)
            c_carry = tuple(rows_of(x, chunk, 1) for x in carry)
            c_carry = lax.fori_loop(
                0, steps, lambda j, cc: masked_update(cc, s, q_c, pos_c, tail0 + j * width, width,
                                                      key_end), c_carry)
            m, l, acc = c_carry
            if sum_pad:
                l, acc = acc[..., head_dim], acc[..., :head_dim]
            outs.append(_normalize(acc, l, m, sink_rows))
            lses.append(_lse(m, l))
        o = jnp.stack([x.reshape(num_kv_heads, group, bq_sub, head_dim) for x in outs], axis=2)
        o = o.reshape(num_kv_heads, group, bq, head_dim).transpose(2, 0, 1, 3)  # [bq, Hkv', G', D]
        new = (o,)
        if want_lse:
            e = jnp.stack([x.reshape(num_kv_heads, group, bq_sub) for x in lses], axis=2)
            new += (e.reshape(num_kv_heads, group, bq).transpose(2, 0, 1),)  # [bq, Hkv', G']
        tok = ib["r0"] + jnp.arange(bq, dtype=jnp.int32)
        mine = (tok >= ib["lo"]) & (tok < ib["hi"]) & ~skip

        def put(out, o):
            keep = mine.reshape((bq,) + (1,) * (o.ndim - 1))
            o = jnp.where(keep, o, lax.dynamic_slice_in_dim(out, b * bq, bq))
            return lax.dynamic_update_slice_in_dim(out, o, b * bq, 0)
        return tuple(put(out, o) for out, o in zip(outs_so_far, new))

    init = (jnp.zeros((t_pad, num_kv_heads, group, head_dim), jnp.float32),)
    if want_lse:
        init += (jnp.full((t_pad, num_kv_heads, group), -jnp.inf, jnp.float32),)
    res = lax.fori_loop(0, num_items, one_item, init)
    return res if want_lse else res[0]


def _attend_short(qs,  # [T, Hq, D] scaled q (log2 units unless soft_cap)
                  kv_pages, kv_scales,
                  sinks,  # [Hkv, G] f32 attention sinks in log2 units, or None
                  pidx, cu, kv_lens, num_seqs,
                  seq_mask,  # [S] bool: the sequences this path serves (each <= q_max new tokens)
                  *, q_max, bk, ppb, sliding_window, soft_cap, exp2_fn, kv_shared=False,
                  stripes, want_lse=False):
    """Sequence-batched path for sequences with <= q_max new tokens (decode, speculative
    decode): one loop over KV blocks, all of them at once, instead of one item per
    sequence. Returns out [T, Hq, D] f32, zeros on rows of other sequences and padding
    (and with `want_lse` the rows' log-sum-exp [T, Hq] f32, -inf there)."""
    num_tokens, num_q_heads, head_dim = qs.shape
    combined = kv_pages.shape[2]
    num_kv_heads = combined if kv_shared else combined // 2
    group = num_q_heads // num_kv_heads
    num_slots = kv_lens.shape[0]
    cdt = qs.dtype
    live = (jnp.arange(num_slots, dtype=jnp.int32) < num_seqs[0]) & seq_mask
    q_len = jnp.where(live, cu[1:] - cu[:-1], 0)
    kv_len = jnp.where(live, kv_lens, 0)
    i = jnp.arange(q_max, dtype=jnp.int32)
    row_ok = i[None, :] < q_len[:, None]  # [S, q_max]
    tok = jnp.where(row_ok, cu[:-1, None] + i[None, :], num_tokens)  # OOB = dropped
    pos = kv_len[:, None] - q_len[:, None] + i[None, :]  # [S, q_max]
    qb = qs.at[jnp.minimum(tok, num_tokens - 1)].get()  # [S, q_max, Hq, D]
    qb = jnp.where(row_ok[..., None, None], qb, jnp.zeros((), cdt))
    qb = qb.reshape(num_slots, q_max, num_kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
    rows = group * q_max
    qb = qb.reshape(num_slots, num_kv_heads, rows, head_dim)
    row_pos = jnp.tile(pos, (1, group))  # [S, R] g-major, like qb's rows
    nkb = -(-stripes.local_count(kv_len) // bk)
    j_hi = jnp.max(nkb)
    if sliding_window is None:
        j_lo = jnp.int32(0)
    else:
        first = stripes.local_count(pos[:, 0] - sliding_window + 1) // bk
        j_lo = jnp.min(jnp.where(q_len > 0, first, j_hi))
    key_iota = jnp.arange(bk, dtype=jnp.int32)

    def step(j, carry):
        m, l, acc = carry
        ids = lax.dynamic_slice_in_dim(pidx, j * ppb, ppb, axis=1)  # [S, ppb]
        kv = kv_pages[ids].reshape(num_slots, bk, combined, head_dim)
        if kv_scales is not None:
            kv = dequantize(kv, kv_scales[ids].reshape(num_slots, bk, combined), cdt)
        key_pos = stripes.to_global(j * bk + key_iota)
        in_len = key_pos[None, :] < kv_len[:, None]  # [S, bk]
        kv = jnp.where(in_len[:, :, None, None], kv, jnp.zeros((), kv.dtype))
        k, v = (x.transpose(0, 2, 1, 3) for x in split_kv(kv, kv_shared))  # [S, Hkv, bk, D]
        sc = jnp.einsum("shrd,shkd->shrk", qb, k, preferred_element_type=jnp.float32)
        if soft_cap is not None:
            sc = (soft_cap * LOG2E) * jnp.tanh(sc / soft_cap)
        vis = (key_pos[None, None, :] <= row_pos[:, :, None]) & in_len[:, None, :]
        if sliding_window is not None:
            vis &= key_pos[None, None, :] > row_pos[:, :, None] - sliding_window
        sc = jnp.where(vis[:, None], sc, MASK_VALUE)
        m_new = jnp.maximum(m, sc.max(axis=-1))
        alpha = exp2_fn(m - m_new)
        p = exp2_fn(sc - m_new[..., None])
        l = alpha * l + p.sum(axis=-1)
        pv = jnp.einsum("shrk,shkd->shrd", p.astype(cdt), v, preferred_element_type=jnp.float32)
        return m_new, l, alpha[..., None] * acc + pv

    carry = (jnp.full((num_slots, num_kv_heads, rows), MASK_VALUE, jnp.float32),
             jnp.zeros((num_slots, num_kv_heads, rows), jnp.float32),
             jnp.zeros((num_slots, num_kv_heads, rows, head_dim), jnp.float32))
    m, l, acc = lax.fori_loop(j_lo, j_hi, step, carry)
    sink_rows = None if sinks is None else jnp.repeat(sinks, q_max, axis=1)  # [Hkv, R] g-major
    o = _normalize(acc, l, m, sink_rows)  # [S, Hkv, R, D]
    o = o.reshape(num_slots, num_kv_heads, group, q_max, head_dim).transpose(0, 3, 1, 2, 4)
    o = o.reshape(num_slots * q_max, num_q_heads, head_dim)
    out = jnp.zeros((num_tokens, num_q_heads, head_dim), jnp.float32)
    out = out.at[tok.reshape(-1)].set(o, mode="drop")
    if not want_lse:
        return out
    e = _lse(m, l).reshape(num_slots, num_kv_heads, group, q_max).transpose(0, 3, 1, 2)
    lse = jnp.full((num_tokens, num_q_heads), -jnp.inf, jnp.float32)
    return out, lse.at[tok.reshape(-1)].set(e.reshape(num_slots * q_max, num_q_heads), mode="drop")


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap",
                                             "block_q", "block_kv", "fast_exp", "sum_pad",
                                             "par", "short_q", "diag_splits", "kv_shared",
                                             "kv_stride", "return_lse"))
def ragged_paged_attention_xla(
    q: jax.Array,  # [T, Hq, D]
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * Hkv, D]
    kv_lens: jax.Array,  # [S] int32
    page_indices: jax.Array,  # [S, P] int32
    cu_q_lens: jax.Array,  # [S+1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    block_q: int | None = None,
    block_kv: int | None = None,
    fast_exp: bool = True,
    sum_pad: int = 0,
    par: int | None = None,
    short_q: int = 1,  # sequences with <= short_q new tokens take the sequence-batched path
    diag_splits: int | None = None,  # row chunks of the causal diagonal; None: block_sizes' rule
    kv_scales: jax.Array | None = None,  # [num_pages, page_size, 2 * Hkv] f32 (int8/fp8 pages)
    sinks: jax.Array | None = None,  # [Hq] f32 attention sinks, natural-log units
    kv_shared: bool = False,  # pages [.., Hkv, D]: K only, V is K
    kv_stride: int = 1,  # context parallelism: this rank holds logical pages kv_offset + i * kv_stride
    kv_offset: jax.Array | None = None,  # int32 scalar, the rank (stripes.py)
    return_lse: bool = False,  # also each row's log-sum-exp [T, Hq] f32 (-inf: no key), out in f32
):  # [T, Hq, D] (and [T, Hq] with return_lse)
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, combined, _ = kv_pages.shape
    keys = stripes(kv_stride, kv_offset, page_size)
    num_kv_heads = combined if kv_shared else combined // 2
    group = num_q_heads // num_kv_heads
    num_slots, max_pages = page_indices.shape
    sizes = xla_block_sizes(num_tokens, num_slots, group, head_dim, q.dtype.itemsize, page_size)
    bq = block_q or sizes.block_q
    bk = block_kv or sizes.block_kv
    if bk % page_size:
        raise ValueError(f"block_kv {bk} must be a multiple of page_size {page_size}")
    ppb = bk // page_size
    if diag_splits is None:
        diag_splits = xla_diagonal_splits(bq, bk, page_size, q.dtype.itemsize)
    if bq % diag_splits or bk % (diag_splits * page_size):
        raise ValueError(f"diag_splits {diag_splits} must divide block_q {bq} and block_kv {bk} "
                         f"into whole pages of {page_size}")
    num_blocks = -(-num_tokens // bq)
    num_kv_blocks = -(-max_pages // ppb)
    cdt = q.dtype  # matmul operand dtype; accumulation is always f32

    cu = sanitize_cu_q_lens(cu_q_lens.astype(jnp.int32), num_seqs)
    kv_lens = kv_lens.astype(jnp.int32)
    pidx = jnp.clip(page_indices.astype(jnp.int32), 0, num_pages - 1)
    # One block past the last: a diagonal window may overrun the last block (zeroed keys).
    pidx = jnp.pad(pidx, ((0, 0), (0, (num_kv_blocks + 1) * ppb - max_pages)))
    item_block, item_seq, num_items = work_items(cu, num_seqs, num_blocks, bq)

    # q scaled so scores come out in log2 units (soft cap: scaled after the tanh).
    q_scale = sm_scale if soft_cap is not None else sm_scale * LOG2E
    exp2_fn = exp2 if fast_exp else jnp.exp2
    # Sinks in the scores' units (log2, with or without a soft cap), per KV head group.
    sinks2 = None if sinks is None else (
        sinks.astype(jnp.float32) * LOG2E).reshape(num_kv_heads, group)  # [Hkv, G]
    if par is None:
        par = xla_parallel_loops(jax.default_backend(), num_kv_heads, group)

    live = jnp.arange(num_slots, dtype=jnp.int32) < num_seqs[0]
    q_lens = jnp.where(live, cu[1:] - cu[:-1], 0)  # [S]

    def by_items(q, seq_skip=jnp.zeros((num_slots,), jnp.bool_)):
        return _by_items(q, kv_pages, kv_scales, sinks2, pidx, cu, kv_lens, item_block, item_seq,
                         num_items, seq_skip, q_scale=q_scale, bq=bq, bk=bk, ppb=ppb, par=par,
                         sliding_window=sliding_window, soft_cap=soft_cap, exp2_fn=exp2_fn,
                         sum_pad=sum_pad, diag_splits=diag_splits, kv_shared=kv_shared,
                         stripes=keys, want_lse=return_lse)

    def finish(res):  # the output in q's dtype; with its LSE, both f32 (they are merged next)
        return res if return_lse else res.astype(q.dtype)

    q_max = min(short_q, num_tokens)
    if q_max <= 0 or num_tokens <= q_max:
        return finish(by_items(q))
    bk_short = kv_block(page_size, 128)
    ppb_short = bk_short // page_size
    pidx_short = jnp.pad(pidx, ((0, 0), (0, -pidx.shape[1] % ppb_short)))

    is_short = q_lens <= q_max  # [S]

    def short(q, seq_mask=jnp.ones((num_slots,), jnp.bool_)):
        q_scaled = (q.astype(jnp.float32) * q_scale).astype(cdt)
        return _attend_short(q_scaled, kv_pages, kv_scales, sinks2, pidx_short, cu, kv_lens, num_seqs, seq_mask,
                             q_max=q_max, bk=bk_short, ppb=ppb_short,
                             sliding_window=sliding_window, soft_cap=soft_cap,
                             exp2_fn=exp2_fn, kv_shared=kv_shared, stripes=keys, want_lse=return_lse)

    def mixed(q):
        """Prefill chunks by items, decodes batched: a decode row alone in its item would
        cost a whole block_q-row query block."""
        row_seq = jnp.searchsorted(cu[1:], jnp.arange(num_tokens, dtype=jnp.int32), side="right")
        short_row = is_short[jnp.minimum(row_seq, num_slots - 1)]  # [T]
        return jax.tree.map(lambda a, b: jnp.where(short_row.reshape((-1,) + (1,) * (a.ndim - 1)), a, b),
                            short(q, is_short), by_items(q, is_short))

    # All short: the batched path alone; none short (a prefill): the items alone, so a
    # prefill pays for neither the batched path's [T, Hq, D] output nor the merge.
    branch = jnp.where(jnp.all(is_short), 0, jnp.where(jnp.any(is_short), 1, 2))
    return finish(lax.switch(branch, [short, mixed, by_items], q))


def _by_items(q, kv_pages, kv_scales,
              sinks,  # [Hkv, G] f32 attention sinks in log2 units, or None
              pidx, cu, kv_lens, item_block, item_seq, num_items, seq_skip, *,
              q_scale, bq, bk, ppb, par, sliding_window, soft_cap, exp2_fn, sum_pad, diag_splits,
              kv_shared=False, stripes, want_lse=False):
    """The item path: q [T, Hq, D] unscaled; returns out [T, Hq, D] f32 (and its LSE
    [T, Hq] f32 with want_lse)."""
    num_tokens, num_q_heads, head_dim = q.shape
    per = 1 if kv_shared else 2  # page entries per KV head
    num_kv_heads = kv_pages.shape[2] // per
    group = num_q_heads // num_kv_heads
    t_pad = -(-num_tokens // bq) * bq
    if t_pad != num_tokens:
        q = jnp.pad(q, ((0, t_pad - num_tokens), (0, 0), (0, 0)))
    q = q.reshape(t_pad, num_kv_heads, group, head_dim)

    # `par` independent loops, split over KV heads, else over the q heads of a KV head.
    if par > 1 and num_kv_heads % par == 0:
        splits = [(c * (num_kv_heads // par), num_kv_heads // par, 0, group) for c in range(par)]
    elif par > 1 and group % par == 0:
        splits = [(0, num_kv_heads, c * (group // par), group // par) for c in range(par)]
    else:
        splits = [(0, num_kv_heads, 0, group)]
    outs = []
    for h0, nh, g0, ng in splits:
        outs.append(_attend(
            q if len(splits) == 1 else q[:, h0:h0 + nh, g0:g0 + ng],
            kv_pages[:, :, per * h0:per * (h0 + nh)] if nh < num_kv_heads else kv_pages,
            kv_scales[:, :, per * h0:per * (h0 + nh)]
            if kv_scales is not None and nh < num_kv_heads else kv_scales,
            sinks if sinks is None or len(splits) == 1 else sinks[h0:h0 + nh, g0:g0 + ng],
            pidx, cu, kv_lens, item_block, item_seq, num_items, seq_skip, q_scale=q_scale,
            bq=bq, bk=bk, ppb=ppb, sliding_window=sliding_window, soft_cap=soft_cap,
            exp2_fn=exp2_fn, sum_pad=sum_pad, diag_splits=diag_splits, kv_shared=kv_shared,
            stripes=stripes, want_lse=want_lse))
    axis = 1 if splits[0][3] == group else 2
    join = lambda parts: parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=axis)
    if not want_lse:
        return join(outs).reshape(t_pad, num_q_heads, head_dim)[:num_tokens]
    out, lse = join([o for o, _ in outs]), join([e for _, e in outs])
    return (out.reshape(t_pad, num_q_heads, head_dim)[:num_tokens],
            lse.reshape(t_pad, num_q_heads)[:num_tokens])
