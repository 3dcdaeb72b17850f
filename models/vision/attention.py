"""The vision towers' encoder attention: full (not causal) attention within segments, blocked
with an online softmax, so it never holds [H, N, N] scores and skips key blocks that no
query of a block may see.

A tower attends each image (Qwen3-VL: each frame) to itself only and pads its rows to a
fixed count (engine/vision/tower.py, Gemma 4's max_patches). Dense attention over the
padded count costs quadratic work and [H, N, N] f32 scores of memory (1.6 GB at 8192 rows,
6 heads). Here the rows are cut into blocks of `block`; for each query block a loop over
key blocks runs the block's scores only when the segment ranges of the two blocks overlap
(lax.cond: the skipped pairs cost nothing), so padding blocks and other images' blocks are
never computed, and a block's scores are [H, block, block]. Segments need not be sorted or
contiguous (the overlap test is on each block's min and max segment; the exact mask is
applied inside), they only skip more when they are, as the towers lay them out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 512  # rows per query / key block: [H, 512, 512] f32 scores at a time


def segment_attention(q: jax.Array,  # [N, H, D]
                      k: jax.Array,  # [N, H, D]
                      v: jax.Array,  # [N, H, D]
                      segments: jax.Array,  # [N] int32: a row's image; < 0: padding (attends and is seen by nothing)
                      scale: float,
                      block: int = BLOCK) -> jax.Array:  # [N, H, D] in q's dtype
    """softmax(scale * q k^T, masked to same segment) v, per head. Scores and the running
    softmax are f32; a padding query (segment < 0) sees no key and returns 0."""
    n, h, d = q.shape
    b = min(block, -(-n // 8) * 8)
    nb = -(-n // b)
    pad = nb * b - n

    def blocks(x):  # [N, H, D] -> [nb, H, b, D]
        return jnp.pad(x, ((0, pad), (0, 0), (0, 0))).reshape(nb, b, h, d).transpose(0, 2, 1, 3)

    keep = (segments >= 0)[:, None, None]  # padding rows may hold anything (NaN): 0 * NaN in p @ v is NaN
    qb, kb, vb = blocks(q), blocks(jnp.where(keep, k, 0)), blocks(jnp.where(keep, v, 0))
    seg = jnp.pad(segments.astype(jnp.int32), (0, pad), constant_values=-1).reshape(nb, b)
    valid = seg >= 0
    lo = jnp.where(valid, seg, jnp.iinfo(jnp.int32).max).min(1)  # [nb]: a block with no valid row has lo > hi
    hi = jnp.where(valid, seg, -1).max(1)  # [nb]

    def query_block(i):  # -> [H, b, D]
        qi, si = qb[i], seg[i]

        def key_block(j, carry):
            def run(carry):
                m, l, acc = carry  # [H, b], [H, b], [H, b, D]
                s = jnp.einsum("hqd,hkd->hqk", qi, kb[j], preferred_element_type=jnp.float32) * scale
                see = (si[:, None] == seg[j][None, :]) & valid[j][None, :]  # [b, b]
                s = jnp.where(see[None], s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(-1))
                base = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row that saw nothing yet: no NaN
                p = jnp.exp(s - base[..., None])
                fix = jnp.exp(m - base)
                pv = jnp.einsum("hqk,hkd->hqd", p.astype(v.dtype), vb[j], preferred_element_type=jnp.float32)
                return m_new, l * fix + p.sum(-1), acc * fix[..., None] + pv

            overlap = (hi[j] >= lo[i]) & (lo[j] <= hi[i])
            return jax.lax.cond(overlap, run, lambda c: c, carry)

        init = (jnp.full((h, b), -jnp.inf, jnp.float32), jnp.zeros((h, b), jnp.float32),
                jnp.zeros((h, b, d), jnp.float32))
        _, l, acc = jax.lax.fori_loop(0, nb, key_block, init)
        return acc / jnp.where(l > 0, l, 1.0)[..., None]

    out = jax.lax.map(query_block, jnp.arange(nb))  # [nb, H, b, D]
    return out.transpose(0, 2, 1, 3).reshape(nb * b, h, d)[:n].astype(q.dtype)

