"""The XLA impl's item path (xla.py): one `fori_loop` over the work items
(work_items.py); per item a loop over that sequence's KV blocks with dynamic bounds, so
nothing above the causal diagonal (or before the sliding window) is computed, not just
masked:

    [kv_lo, a)    masked   (window edge: some keys too old for some rows)
    [a, c)        unmasked (every row of the item sees every key: no mask, no NaN guard)
    [c, kv_hi)    masked   (causal diagonal, and the partial last page; per row chunk,
                           so most of the tile above the diagonal is skipped too)

The G query heads of one KV head are stacked into one [G*block_q, D] operand, so each
step is a batched matmul over KV heads; `par` > 1 splits the heads into independent
loops (off by default, see block_sizes.xla_parallel_loops).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxfill.pallas_kernels.kv_cache import kv_slots, page_values, split_kv
from jaxfill.pallas_kernels.kv_quant import dequantize
from jaxfill.pallas_kernels.ragged_paged_attention.online_softmax import LOG2E, MASK_VALUE, log_sum_exp, normalize
from jaxfill.pallas_kernels.ragged_paged_attention.work_items import item_bounds
from jaxfill.pallas_kernels.ragged_paged_attention.window import in_window


def by_items(q, kv_pages, kv_scales,
             sinks,  # [Hkv, G] f32 attention sinks in log2 units, or None
             pidx, cu, kv_lens, item_block, item_seq, num_items, seq_skip, *,
             q_scale, bq, bk, ppb, par, sliding_window, attention_chunk, soft_cap, exp2_fn, sum_pad, diag_splits,
             kv_shared=False, stripes, want_lse=False, key_limits=None):
    """The item path: q [T, Hq, D] unscaled; returns out [T, Hq, D] f32 (and its LSE
    [T, Hq] f32 with want_lse). key_limits [T] int32 or None: a row sees keys up to
    max(its position, its limit) (Gemma 3's image rows)."""
    num_tokens, num_q_heads, head_dim = q.shape
    per = 1 if kv_shared else 2  # page entries per KV head
    num_kv_heads = kv_pages.shape[2] // per
    group = num_q_heads // num_kv_heads
    t_pad = -(-num_tokens // bq) * bq
    if t_pad != num_tokens:
        q = jnp.pad(q, ((0, t_pad - num_tokens), (0, 0), (0, 0)))
        if key_limits is not None:
            key_limits = jnp.pad(key_limits, (0, t_pad - num_tokens), constant_values=-1)
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
        outs.append(attend_items(
            q if len(splits) == 1 else q[:, h0:h0 + nh, g0:g0 + ng],
            kv_pages[:, :, per * h0:per * (h0 + nh)] if nh < num_kv_heads else kv_pages,
            kv_scales[:, :, per * h0:per * (h0 + nh)]
            if kv_scales is not None and nh < num_kv_heads else kv_scales,
            sinks if sinks is None or len(splits) == 1 else sinks[h0:h0 + nh, g0:g0 + ng],
            pidx, cu, kv_lens, item_block, item_seq, num_items, seq_skip, q_scale=q_scale,
            bq=bq, bk=bk, ppb=ppb, sliding_window=sliding_window, attention_chunk=attention_chunk, soft_cap=soft_cap,
            exp2_fn=exp2_fn, sum_pad=sum_pad, diag_splits=diag_splits, kv_shared=kv_shared,
            stripes=stripes, want_lse=want_lse, key_limits=key_limits))
    axis = 1 if splits[0][3] == group else 2
    join = lambda parts: parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=axis)
    if not want_lse:
        return join(outs).reshape(t_pad, num_q_heads, head_dim)[:num_tokens]
    out, lse = join([o for o, _ in outs]), join([e for _, e in outs])
    return (out.reshape(t_pad, num_q_heads, head_dim)[:num_tokens],
            lse.reshape(t_pad, num_q_heads)[:num_tokens])


def attend_items(q,  # [T_pad, Hkv', G', D] unscaled q, T_pad a multiple of bq; R = G' * bq
                 kv_pages,  # [num_pages, page_size, 2 * Hkv', D]
                 kv_scales,  # [num_pages, page_size, 2 * Hkv'] f32, or None (unquantized pages)
                 sinks,  # [Hkv', G'] f32 attention sinks in log2 units, or None
                 pidx,  # [S, P'] int32 page table padded to whole KV blocks, plus one block
                 cu, kv_lens, item_block, item_seq, num_items,
                 seq_skip,  # [S] bool: sequences another path serves (their items do nothing)
                 *, q_scale, bq, bk, ppb, sliding_window, attention_chunk, soft_cap, exp2_fn, sum_pad, diag_splits,
                 kv_shared=False, stripes=None, want_lse=False,
                 key_limits=None):  # [T_pad] int32 or None: rows that see keys past their own position
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
        kv = page_values(kv_pages[ids]).reshape(npages * page_size, combined, head_dim)
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

    def masked_update(carry, s, qb, row_pos, key0, nkeys, key_end, row_last):
        """One masked step over keys [key0, key0 + nkeys); keys >= key_end are zeroed; a row
        sees keys up to row_last (its position, or past it with key_limits)."""
        k, v = load_kv(s, key0 // page_size, nkeys // page_size)
        key_pos = stripes.to_global(key0 + jnp.arange(nkeys, dtype=jnp.int32))
        in_len = (key_pos < key_end)[None, :, None]
        k = jnp.where(in_len, k, jnp.zeros((), k.dtype))
        v = jnp.where(in_len, v, jnp.zeros((), v.dtype))
        sc = scores_of(qb, k)
        vis = (key_pos[None, :] <= row_last[:, None]) & (key_pos[None, :] < key_end)
        window = in_window(key_pos[None, :], row_pos[:, None], sliding_window, attention_chunk)
        if window is not None:
            vis &= window
        sc = jnp.where(vis[None], sc, MASK_VALUE)
        return update(carry, sc, v)

    def rows_of(x, chunk, axis):  # chunk `chunk`'s rows of x, whose R rows are at `axis`
        shape = x.shape
        y = x.reshape(shape[:axis] + (group, nsub, bq_sub) + shape[axis + 1:])
        y = lax.index_in_dim(y, chunk, axis + 1, keepdims=False)
        return y.reshape(shape[:axis] + (group * bq_sub,) + shape[axis + 1:])

    def one_item(i, outs_so_far):
        b, s = item_block[i], item_seq[i]
        ib = item_bounds(b, s, cu, kv_lens, bq, bk, sliding_window, stripes, attention_chunk)
        row_tok = ib["r0"] + row_in_block  # flat token of each row
        row_pos = ib["ctx"] + row_tok - ib["q_start"]  # [R]
        row_last = row_pos
        if key_limits is not None:  # the item's rows may see keys past the diagonal: the KV loop runs further
            in_item = (row_tok >= ib["lo"]) & (row_tok < ib["hi"])
            row_last = jnp.where(in_item, jnp.maximum(row_pos, jnp.tile(
                lax.dynamic_slice_in_dim(key_limits, b * bq, bq), group)), row_pos)
            far = jnp.minimum(jnp.max(jnp.where(in_item, row_last, 0)) + 1, ib["kv_len"])
            ib["kv_hi"] = jnp.maximum(ib["kv_hi"], lax.div(far + bk - 1, jnp.int32(bk)))
        skip = seq_skip[s]
        for edge in ("a", "c", "kv_hi"):  # a skipped item runs no KV block at all
            ib[edge] = jnp.where(skip, ib["kv_lo"], ib[edge])
        qb = lax.dynamic_slice_in_dim(q, b * bq, bq)  # [bq, Hkv', G', D]
        qb = (qb.astype(jnp.float32) * q_scale).astype(cdt)
        qb = qb.transpose(1, 2, 0, 3).reshape(num_kv_heads, rows, head_dim)  # [Hkv', R, D]

        def masked_step(j, carry):
            return masked_update(carry, s, qb, row_pos, j * bk, bk, ib["kv_len"], row_last)

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
            last_c = rows_of(row_last, chunk, 0)
            if key_limits is not None:  # the chunk's rows past the diagonal: its keys run to their last
                far_c = jnp.max(rows_of(jnp.where(in_item, row_last, 0), chunk, 0)) + 1
                key_end = jnp.maximum(key_end, jnp.minimum(far_c, ib["kv_len"]))
            need = jnp.clip(stripes.local_count(key_end) - tail0, 0, tail_len)
            steps = lax.div(need + width - 1, jnp.int32(width))
            q_c, pos_c = rows_of(qb, chunk, 1), rows_of(row_pos, chunk, 0)
            c_carry = tuple(rows_of(x, chunk, 1) for x in carry)
            c_carry = lax.fori_loop(
                0, steps, lambda j, cc: masked_update(cc, s, q_c, pos_c, tail0 + j * width, width,
                                                      key_end, last_c), c_carry)
            m, l, acc = c_carry
            if sum_pad:
                l, acc = acc[..., head_dim], acc[..., :head_dim]
            outs.append(normalize(acc, l, m, sink_rows))
            lses.append(log_sum_exp(m, l))
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
