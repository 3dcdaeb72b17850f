"""The XLA impl's sequence-batched path (xla.py) for sequences with <= `short_q` new
tokens (decodes, speculative decodes): one loop over KV blocks that serves all of them at
once ([S, Hkv, G*short_q, D] x [S, Hkv, block, D] per step), rather than one item, and
one short loop, per sequence; so a decode row never costs a whole block_q-row query block.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxfill.pallas_kernels.kv_cache import page_values, split_kv
from jaxfill.pallas_kernels.kv_quant import dequantize
from jaxfill.pallas_kernels.ragged_paged_attention.online_softmax import LOG2E, MASK_VALUE, log_sum_exp, normalize
from jaxfill.pallas_kernels.ragged_paged_attention.window import in_window, window_start


def attend_short(qs,  # [T, Hq, D] scaled q (log2 units unless soft_cap)
                 kv_pages, kv_scales,
                 sinks,  # [Hkv, G] f32 attention sinks in log2 units, or None
                 pidx, cu, kv_lens, num_seqs,
                 seq_mask,  # [S] bool: the sequences this path serves (each <= q_max new tokens)
                 *, q_max, bk, ppb, sliding_window, attention_chunk, soft_cap, exp2_fn, kv_shared=False,
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
    start = window_start(pos[:, 0], sliding_window, attention_chunk)
    if start is None:
        j_lo = jnp.int32(0)
    else:
        first = stripes.local_count(start) // bk
        j_lo = jnp.min(jnp.where(q_len > 0, first, j_hi))
    key_iota = jnp.arange(bk, dtype=jnp.int32)

    def step(j, carry):
        m, l, acc = carry
        ids = lax.dynamic_slice_in_dim(pidx, j * ppb, ppb, axis=1)  # [S, ppb]
        kv = page_values(kv_pages[ids]).reshape(num_slots, bk, combined, head_dim)
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
        window = in_window(key_pos[None, None, :], row_pos[:, :, None], sliding_window, attention_chunk)
        if window is not None:
            vis &= window
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
    o = normalize(acc, l, m, sink_rows)  # [S, Hkv, R, D]
    o = o.reshape(num_slots, num_kv_heads, group, q_max, head_dim).transpose(0, 3, 1, 2, 4)
    o = o.reshape(num_slots * q_max, num_q_heads, head_dim)
    out = jnp.zeros((num_tokens, num_q_heads, head_dim), jnp.float32)
    out = out.at[tok.reshape(-1)].set(o, mode="drop")
    if not want_lse:
        return out
    e = log_sum_exp(m, l).reshape(num_slots, num_kv_heads, group, q_max).transpose(0, 3, 1, 2)
    lse = jnp.full((num_tokens, num_q_heads), -jnp.inf, jnp.float32)
    return out, lse.at[tok.reshape(-1)].set(e.reshape(num_slots * q_max, num_q_heads), mode="drop")
