"""Pure-jnp ragged paged attention: slow, obviously right, the oracle for every impl.

One flat token array holds all sequences back to back (`cu_q_lens`). Sequence s has
`kv_lens[s]` tokens in its pages (cached + new); its q_len new tokens are its last ones,
so query i of s sits at position `kv_lens[s] - q_len(s) + i`. The loop runs over
sequences, each time scoring every query against that sequence's keys and keeping the
rows that belong to it; cost is S x T x K, fine for a reference.

`key_limits` (Gemma 3's image rows): a row sees keys up to max(its position, its limit),
so an image's rows see the whole image, the window still starting at the row's own position.

Attention sinks (gpt-oss) are what they are defined as: one more score column per head,
`sinks[h]`, in the softmax, dropped before the PV product (it has no value vector).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfill.pallas_kernels.kv_cache import page_values, split_kv
from jaxfill.pallas_kernels.kv_quant import dequantize
from jaxfill.pallas_kernels.ragged_paged_attention.stripes import stripes
from jaxfill.pallas_kernels.ragged_paged_attention.window import in_window

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: no inf - inf = NaN


def token_layout(cu_q_lens: jax.Array,  # [S+1]
                 kv_lens: jax.Array,  # [S]
                 num_seqs: jax.Array,  # [1]
                 num_tokens: int):
    """Per-token sequence id, position and validity: each [T]."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, kv_lens.shape[0] - 1)
    valid = t < cu_q_lens[num_seqs[0]]
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (t - cu_q_lens[seq])
    return seq, pos, valid


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, Hq, D]
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * Hkv, D]
    kv_lens: jax.Array,  # [S] int32
    page_indices: jax.Array,  # [S, P] int32
    cu_q_lens: jax.Array,  # [S+1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    attention_chunk: int | None = None,  # keys of the row's own chunk of C positions only (window.py)
    soft_cap: float | None = None,
    kv_scales: jax.Array | None = None,  # [num_pages, page_size, 2 * Hkv] f32 (int8/fp8 pages)
    sinks: jax.Array | None = None,  # [Hq] f32, natural-log units
    kv_shared: bool = False,  # pages [.., Hkv, D]: K only, V is K
    kv_stride: int = 1,  # context parallelism: pages hold logical pages kv_offset + i * kv_stride
    kv_offset: jax.Array | None = None,  # int32 scalar (stripes.py)
    return_lse: bool = False,  # also each row's log-sum-exp [T, Hq] f32 (-inf: no key), out in f32
    key_limits: jax.Array | None = None,  # [T] int32: a row sees keys up to max(its position, this)
):  # [T, Hq, D] (and [T, Hq] with return_lse)
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, combined, _ = kv_pages.shape
    num_kv_heads = combined if kv_shared else combined // 2
    group = num_q_heads // num_kv_heads
    max_kv = page_indices.shape[1] * page_size
    seq_of, pos, valid = token_layout(cu_q_lens, kv_lens, num_seqs, num_tokens)
    last = pos if key_limits is None else jnp.maximum(pos, key_limits)  # [T] the last key each row sees
    qf = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    key_pos = stripes(kv_stride, kv_offset, page_size).to_global(jnp.arange(max_kv, dtype=jnp.int32))

    def one_sequence(s, out):
        kv = page_values(kv_pages[page_indices[s]]).reshape(max_kv, combined, head_dim)
        scale = None if kv_scales is None else kv_scales[page_indices[s]].reshape(max_kv, combined)
        k, v = split_kv(dequantize(kv, scale, jnp.float32), kv_shared)  # [K, Hkv, D]
        in_len = key_pos < kv_lens[s]
        # Unused page slots may hold anything (NaN in tests): zero them before any math.
        k = jnp.where(in_len[:, None, None], k, 0.0)
        v = jnp.where(in_len[:, None, None], v, 0.0)
        scores = jnp.einsum("thgd,khd->thgk", qf, k) * sm_scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        visible = in_len[None, :] & (key_pos[None, :] <= last[:, None])
        window = in_window(key_pos[None, :], pos[:, None], sliding_window, attention_chunk)
        if window is not None:
            visible &= window
        scores = jnp.where(visible[:, None, None, :], scores, MASK_VALUE)
        if sinks is None:
            probs = jax.nn.softmax(scores, axis=-1)
        else:
            sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(num_kv_heads, group, 1),
                                    scores.shape[:-1] + (1,))
            probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
        o = jnp.einsum("thgk,khd->thgd", probs, v)
        mine = (seq_of == s) & valid
        if not return_lse:
            return jnp.where(mine[:, None, None, None], o, out)
        # a rank's share may hold no key a row can see: its output 0, its LSE -inf
        seen = jnp.any(visible, axis=-1)[:, None, None]  # [T, 1, 1]
        lse = jnp.where(seen, jax.nn.logsumexp(scores, axis=-1), -jnp.inf)  # [T, Hkv, G]
        o = jnp.where(seen[..., None], o, 0.0)
        return jnp.where(mine[:, None, None, None], o, out[0]), jnp.where(mine[:, None, None], lse, out[1])

    if not return_lse:
        out = jax.lax.fori_loop(0, num_seqs[0], one_sequence, jnp.zeros_like(qf))
        return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
    out = (jnp.zeros_like(qf), jnp.full(qf.shape[:3], -jnp.inf, jnp.float32))
    out, lse = jax.lax.fori_loop(0, num_seqs[0], one_sequence, out)
    return out.reshape(num_tokens, num_q_heads, head_dim), lse.reshape(num_tokens, num_q_heads)
