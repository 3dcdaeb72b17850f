"""The gated delta rule (Gated DeltaNet: Qwen3.5, Qwen3-Next) over a flat ragged token array.

Per head, with a state S [K, V] per sequence, for each token t:

    S   = exp(g_t) * S                         (g_t <= 0: the gate's log decay)
    S   = S + k_t (beta_t * (v_t - S^T k_t))^T (the delta rule: write v_t at key k_t)
    o_t = S^T q_t

Tokens arrive as the attention layers see them: one flat [T] array, sequence boundaries
in `cu_q_lens` (prefill chunks and decodes side by side), each sequence starting from
its own state (`states [S, H, K, V]`, from the slot pool) and leaving its final one.

Two algorithms, the same function of their inputs:
* `gated_delta_rule_recurrent`: one token at a time (a `lax.scan` over T), the oracle's
  twin in JAX.
* `gated_delta_rule_chunked`: each decode (a sequence with one token in the step) by the
  per-token `token_step`, all decodes at once; every longer sequence in chunks of
  `chunk` tokens of one sequence each (a chunk never spans two sequences: `chunk_table`;
  `scan_ragged` in ragged_scan.py does the split). Within a chunk the C sequential rank-one
  updates become matmuls: with G the chunk's cumulative log decay and
  L_ij = exp(G_i - G_j) (j <= i), the UT transform T = (I + strict_lower(beta_i k_i.k_j L_ij))^-1
  (a product of log2(C) matmul rounds, `unit_lower_inverse`) turns the delta corrections into U = T (beta v) and W = T (beta exp(G) k); then
    o     = exp(G) q S + (q k^T * L) (U - W S)
    S_out = exp(G_C) S + (exp(G_C - G) k)^T (U - W S)
  (the WY/UT form of the chunked delta rule, as in flash-linear-attention). Chunks are
  visited in order by a loop carrying S; a sequence's first chunk starts from its
  slot's state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxfill.pallas_kernels.ragged_scan import chunk_table, scan_ragged, scan_tokens, token_sequences

__all__ = ["chunk_table", "gated_delta_rule_chunked", "gated_delta_rule_recurrent", "token_sequences", "token_step",
           "unit_lower_inverse"]


def token_step(state: jax.Array,  # [H, K, V] f32
               qt, kt,  # [H, K] one row's inputs
               vt,  # [H, V]
               gt, bt,  # [H]
               ) -> tuple[jax.Array, jax.Array]:  # o [H, V], state [H, K, V]
    """The recurrence, rearranged so the old state is read once (S^T k and S^T q, before
    the decay) and the new one written once: a decode is bound by the state's bytes.
    With d = exp(g): delta = beta (v - d S^T k), S' = d S + k delta^T,
    o = S'^T q = d S^T q + (k.q) delta."""
    d = jnp.exp(gt)[:, None]  # [H, 1]
    sk, sq = jnp.einsum("hkv,jhk->jhv", state, jnp.stack([kt, qt]))  # [H, V] each
    delta = bt[:, None] * (vt - d * sk)
    o = d * sq + jnp.sum(kt * qt, axis=-1, keepdims=True) * delta
    return o, state * d[:, :, None] + kt[:, :, None] * delta[:, None, :]


def gated_delta_rule_recurrent(q: jax.Array,  # [T, H, K]
                               k: jax.Array,  # [T, H, K]
                               v: jax.Array,  # [T, H, V]
                               g: jax.Array,  # [T, H] log decay (<= 0)
                               beta: jax.Array,  # [T, H]
                               cu_q_lens: jax.Array,  # [S+1] int32
                               num_seqs: jax.Array,  # [1] int32
                               states: jax.Array,  # [S, H, K, V] each sequence's state before its rows
                               ) -> tuple[jax.Array, jax.Array]:  # o [T, H, V], states [S, H, K, V]
    o, states = scan_tokens(token_step, (q, k, v, g, beta), cu_q_lens, num_seqs, states)
    return o.astype(v.dtype), states


def unit_lower_inverse(a: jax.Array) -> jax.Array:  # [..., C, C] strictly lower -> (I + a)^-1
    """(I + A)^-1 = (I - A)(I + A^2)(I + A^4)... for a nilpotent A (A^C = 0): log2(C)
    rounds of two matmuls each, where a triangular solve is C dependent row updates (and
    on XLA:CPU a LAPACK call per head, 10x slower at C = 64)."""
    c = a.shape[-1]
    eye = jnp.eye(c, dtype=a.dtype)
    inv, power = eye - a, a
    for _ in range(max(0, (c - 1).bit_length() - 1)):
        power = power @ power
        inv = inv @ (eye + power)
    return inv


def _chunk(state: jax.Array,  # [H, K, V] f32
           q, k,  # [C, H, K] f32 (rows past the sequence's end zero)
           v,  # [C, H, V]
           g, beta,  # [C, H] (zero past the end: no decay, no write)
           ) -> tuple[jax.Array, jax.Array]:  # o [C, H, V], state [H, K, V]
    c = q.shape[0]
    big_g = jnp.cumsum(g, axis=0).T  # [H, C]
    q, k, v, beta = q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2), beta.T  # heads first
    lower = jnp.tril(jnp.ones((c, c), bool))
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, big_g[:, :, None] - big_g[:, None, :], 0.0)), 0.0)  # [H, C, C]
    kk = jnp.einsum("hik,hjk->hij", k, k) * decay * beta[:, :, None]
    t = unit_lower_inverse(jnp.where(jnp.tril(jnp.ones((c, c), bool), -1), kk, 0.0))  # (I + strict lower)^-1
    u = jnp.einsum("hij,hjv->hiv", t, v * beta[:, :, None])  # [H, C, V]
    w = jnp.einsum("hij,hjk->hik", t, k * (beta * jnp.exp(big_g))[:, :, None])  # [H, C, K]
    new_v = u - jnp.einsum("hck,hkv->hcv", w, state)
    qk = jnp.einsum("hik,hjk->hij", q, k) * decay
    o = jnp.einsum("hck,hkv->hcv", q * jnp.exp(big_g)[:, :, None], state) + jnp.einsum("hij,hjv->hiv", qk, new_v)
    last = big_g[:, -1]  # [H]
    k_out = k * jnp.exp(last[:, None] - big_g)[:, :, None]
    state = state * jnp.exp(last)[:, None, None] + jnp.einsum("hck,hcv->hkv", k_out, new_v)
    return o.transpose(1, 0, 2), state


@functools.partial(jax.jit, static_argnames=("chunk",))
def gated_delta_rule_chunked(q: jax.Array,  # [T, H, K]
                             k: jax.Array,  # [T, H, K]
                             v: jax.Array,  # [T, H, V]
                             g: jax.Array,  # [T, H] log decay (<= 0)
                             beta: jax.Array,  # [T, H]
                             cu_q_lens: jax.Array,  # [S+1] int32
                             num_seqs: jax.Array,  # [1] int32
                             states: jax.Array,  # [S, H, K, V]
                             chunk: int = 64,
                             ) -> tuple[jax.Array, jax.Array]:  # o [T, H, V], states [S, H, K, V]
    o, states = scan_ragged(token_step, _chunk, (q, k, v, g, beta), cu_q_lens, num_seqs, states, chunk, v.shape[1:])
    return o.astype(v.dtype), states
