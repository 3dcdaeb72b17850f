"""Pass-KV ring attention for a step with nothing cached (models/parallel/context.py).

When no sequence in the step has cached keys (fresh prompts, unchunked or a first
chunk), every key a row can see is one of the step's own new rows. Then the queries and
outputs can stay where they are and only the new K/V travel: N - 1 `ppermute` hops of
each rank's [T/N, Hkv, D] block round the ring, against pass-Q's all-gather of Q and K/V
plus a reduce-scatter of f32 outputs. With GQA that is (Hq/Hkv + ...) times fewer bytes.

At hop i rank r holds rank (r - i) mod N's block. It writes the rows of that block whose
pages it owns (so after N hops every row is in its page, exactly as pass-Q leaves the
pool), and folds the block into an online softmax of its own query rows, masked by
sequence, causality and the window, sliding or chunked (positions and sequence ids come from the
step's metadata, so a block straddling sequences is fine). The block attention is dense
[T/N x T/N] per hop in f32: fully masked blocks (keys after every query) are computed and
discarded, so on compute it does up to 2x the causal minimum that pass-Q's paged kernel
does; what it saves is bytes, which only a real interconnect can turn into time.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxfill.pallas_kernels import write_kv
from jaxfill.pallas_kernels.ragged_paged_attention.reference import token_layout
from jaxfill.pallas_kernels.ragged_paged_attention.stripes import local_slots
from jaxfill.pallas_kernels.ragged_paged_attention.window import in_window


class RingSpec(NamedTuple):
    """What the ring computes itself that the kernel otherwise would (all static)."""
    sm_scale: float
    soft_cap: float | None = None
    sliding_window: int | None = None
    attention_chunk: int | None = None  # Llama 4's chunked local layers


def no_cached_keys(meta) -> jax.Array:  # bool scalar
    """True when every live sequence's keys are all new in this step (kv_len == q_len)."""
    live = jnp.arange(meta.kv_lens.shape[0]) < meta.num_seqs[0]
    q_lens = meta.cu_q_lens[1:] - meta.cu_q_lens[:-1]
    return jnp.all(jnp.where(live, meta.kv_lens == q_lens, True))


def ring_attention(q: jax.Array,  # [n, Hq, D] this rank's rows (n = T / N)
                   k: jax.Array,  # [n, Hkv, D]
                   v: jax.Array,  # [n, Hkv, D]
                   pages: jax.Array,  # [P/N, page_size, 2 Hkv, D] this rank's pages
                   meta,  # the whole step's AttentionMetadata (global slots)
                   spec: RingSpec, axis: str, count: int,
                   sinks: jax.Array | None = None,  # [Hq] f32 attention sinks
                   ) -> tuple[jax.Array, jax.Array]:  # out [n, Hq, D] in q's dtype, pages
    n, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    rank = jax.lax.axis_index(axis)
    per_rank, page_size = pages.shape[0], pages.shape[1]
    seq, pos, valid = token_layout(meta.cu_q_lens, meta.kv_lens, meta.num_seqs, n * count)
    rows = lambda x, src: jax.lax.dynamic_slice_in_dim(x, src * n, n)  # noqa: E731
    q_seq, q_pos, q_ok = rows(seq, rank), rows(pos, rank), rows(valid, rank)
    qf = jnp.where(q_ok[:, None, None], q.astype(jnp.float32), 0.0).reshape(n, num_kv_heads, group, head_dim)
    qf = qf * spec.sm_scale
    m = jnp.full((n, num_kv_heads, group), -jnp.inf, jnp.float32)
    l = jnp.zeros_like(m)
    acc = jnp.zeros((n, num_kv_heads, group, head_dim), jnp.float32)
    ring = [(j, (j + 1) % count) for j in range(count)]
    for hop in range(count):  # static: XLA may overlap each ppermute with the next block
        src = (rank - hop) % count
        pages = write_kv(pages, k, v, local_slots(rows(meta.slot_mapping, src), rank, per_rank, page_size))
        k_ok = rows(valid, src)
        kf, vf = (jnp.where(k_ok[:, None, None], x.astype(jnp.float32), 0.0) for x in (k, v))  # padding rows: anything
        sc = jnp.einsum("nhgd,mhd->nhgm", qf, kf)
        if spec.soft_cap is not None:
            sc = spec.soft_cap * jnp.tanh(sc / spec.soft_cap)
        k_pos = rows(pos, src)
        vis = (rows(seq, src)[None, :] == q_seq[:, None]) & (k_pos[None, :] <= q_pos[:, None])
        vis &= k_ok[None, :] & q_ok[:, None]
        window = in_window(k_pos[None, :], q_pos[:, None], spec.sliding_window, spec.attention_chunk)
        if window is not None:
            vis &= window
        sc = jnp.where(vis[:, None, None, :], sc, -jnp.inf)
        m_new = jnp.maximum(m, sc.max(axis=-1))
        base = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(sc - base[..., None])  # 0 where masked
        alpha = jnp.exp(m - base)  # 0 while nothing was seen
        l = alpha * l + p.sum(axis=-1)
        acc = alpha[..., None] * acc + jnp.einsum("nhgm,mhd->nhgd", p, vf)
        m = m_new
        if hop < count - 1:
            k, v = jax.lax.ppermute((k, v), axis, ring)
    if sinks is not None:
        s = sinks.astype(jnp.float32).reshape(num_kv_heads, group)[None]
        l = l + jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(n, num_q_heads, head_dim).astype(q.dtype), pages
