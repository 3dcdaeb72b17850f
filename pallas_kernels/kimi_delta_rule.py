"""The Kimi delta rule (KDA, Kimi Linear) over a flat ragged token array.

The gated delta rule (gated_delta_rule.py) with a decay per key channel instead of one per
head: per head, with a state S [K, V] per sequence, for each token t

    S   = diag(exp(g_t)) S                     (g_t [K] <= 0: each key row's log decay)
    S   = S + k_t (beta_t * (v_t - S^T k_t))^T (the delta rule: write v_t at key k_t)
    o_t = S^T q_t

Two algorithms, the same function of their inputs (tests/test_kimi_delta_rule.py holds
both to a float64 token-by-token oracle):
* `kimi_delta_rule_recurrent`: one token at a time (`scan_tokens`), the oracle's twin.
* `kimi_delta_rule_chunked`: decodes by the token step, all at once; longer sequences in
  chunks of one sequence each (`scan_ragged`). With G_i the chunk's cumulative log decay
  (a [K] vector per row) and L_ijk = exp(G_ik - G_jk) for j <= i, the gated delta rule's
  WY/UT form holds with every k_i . k_j (and q_i . k_j) weighed per channel:
    A_ij  = beta_i sum_k k_ik k_jk L_ijk (j < i),  T = (I + A)^-1
    U     = T (beta v),  W = T (beta exp(G) * k)
    o     = (exp(G) * q) S + M (U - W S),  M_ij = sum_k q_ik k_jk L_ijk (j <= i)
    S_out = diag(exp(G_C)) S + (exp(G_C - G) * k)^T (U - W S)
  The per-channel weights make A and M [C, C, K] products, not one matmul; every
  exponent is <= 0 (no exp(-G) factor that a strong decay could overflow), so the form
  is exact wherever the recurrence is. A Pallas kernel would split the chunk into
  sub-chunks whose pairs factor as (k_i exp(G_i - G_r)) . (k_j exp(G_r - G_j)) around a
  reference row r inside the sub-chunk (flash-linear-attention's KDA kernel).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxfill.pallas_kernels.gated_delta_rule import unit_lower_inverse
from jaxfill.pallas_kernels.ragged_scan import scan_ragged, scan_tokens

__all__ = ["kimi_delta_rule_chunked", "kimi_delta_rule_recurrent", "token_step"]


def token_step(state: jax.Array,  # [H, K, V] f32
               qt, kt,  # [H, K] one row's inputs
               vt,  # [H, V]
               gt,  # [H, K] log decay per key channel
               bt,  # [H]
               ) -> tuple[jax.Array, jax.Array]:  # o [H, V], state [H, K, V]
    """The old state read once (S^T (d k) and S^T (d q), d = exp(g) folded into the
    vectors) and the new one written once: delta = beta (v - S^T (d k)),
    S' = d S + k delta^T, o = S^T (d q) + (k . q) delta."""
    d = jnp.exp(gt)  # [H, K]
    sk, sq = jnp.einsum("hkv,jhk->jhv", state, jnp.stack([d * kt, d * qt]))  # [H, V] each
    delta = bt[:, None] * (vt - sk)
    o = sq + jnp.sum(kt * qt, axis=-1, keepdims=True) * delta
    return o, state * d[:, :, None] + kt[:, :, None] * delta[:, None, :]


def kimi_delta_rule_recurrent(q: jax.Array,  # [T, H, K]
                              k: jax.Array,  # [T, H, K]
                              v: jax.Array,  # [T, H, V]
                              g: jax.Array,  # [T, H, K] log decay (<= 0)
                              beta: jax.Array,  # [T, H]
                              cu_q_lens: jax.Array,  # [S+1] int32
                              num_seqs: jax.Array,  # [1] int32
                              states: jax.Array,  # [S, H, K, V] each sequence's state before its rows
                              ) -> tuple[jax.Array, jax.Array]:  # o [T, H, V], states [S, H, K, V]
    o, states = scan_tokens(token_step, (q, k, v, g, beta), cu_q_lens, num_seqs, states)
    return o.astype(v.dtype), states


def _chunk(state: jax.Array,  # [H, K, V] f32
           q, k,  # [C, H, K] f32 (rows past the sequence's end zero)
           v,  # [C, H, V]
           g,  # [C, H, K] (zero past the end: no decay)
           beta,  # [C, H] (zero past the end: no write)
           ) -> tuple[jax.Array, jax.Array]:  # o [C, H, V], state [H, K, V]
    c = q.shape[0]
    big_g = jnp.cumsum(g, axis=0).transpose(1, 0, 2)  # [H, C, K]
    q, k, v, beta = q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2), beta.T  # heads first
    lower = jnp.tril(jnp.ones((c, c), bool))[None, :, :, None]  # [1, C, C, 1]
    diff = big_g[:, :, None, :] - big_g[:, None, :, :]  # [H, C, C, K]: G_i - G_j
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0.0)), 0.0)
    kk = jnp.einsum("hik,hjk,hijk->hij", k, k, decay) * beta[:, :, None]
    t = unit_lower_inverse(jnp.where(jnp.tril(jnp.ones((c, c), bool), -1), kk, 0.0))  # (I + strict lower)^-1
    u = jnp.einsum("hij,hjv->hiv", t, v * beta[:, :, None])  # [H, C, V]
    w = jnp.einsum("hij,hjk->hik", t, k * beta[:, :, None] * jnp.exp(big_g))  # [H, C, K]
    new_v = u - jnp.einsum("hck,hkv->hcv", w, state)
    qk = jnp.einsum("hik,hjk,hijk->hij", q, k, decay)
    o = jnp.einsum("hck,hkv->hcv", q * jnp.exp(big_g), state) + jnp.einsum("hij,hjv->hiv", qk, new_v)
    last = big_g[:, -1]  # [H, K]
    k_out = k * jnp.exp(last[:, None, :] - big_g)
    state = state * jnp.exp(last)[:, :, None] + jnp.einsum("hck,hcv->hkv", k_out, new_v)
    return o.transpose(1, 0, 2), state


@functools.partial(jax.jit, static_argnames=("chunk",))
def kimi_delta_rule_chunked(q: jax.Array,  # [T, H, K]
                            k: jax.Array,  # [T, H, K]
                            v: jax.Array,  # [T, H, V]
                            g: jax.Array,  # [T, H, K] log decay (<= 0)
                            beta: jax.Array,  # [T, H]
                            cu_q_lens: jax.Array,  # [S+1] int32
                            num_seqs: jax.Array,  # [1] int32
                            states: jax.Array,  # [S, H, K, V]
                            chunk: int = 32,
                            ) -> tuple[jax.Array, jax.Array]:  # o [T, H, V], states [S, H, K, V]
    """chunk = 32: the [H, C, C, K] pair weights are 16 MiB a chunk at Kimi Linear's 32
    heads of 128 (64 MiB at 64)."""
    o, states = scan_ragged(token_step, _chunk, (q, k, v, g, beta), cu_q_lens, num_seqs, states, chunk, v.shape[1:])
    return o.astype(v.dtype), states
