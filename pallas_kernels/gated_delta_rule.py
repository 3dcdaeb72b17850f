"""The gated delta rule (Gated DeltaNet: Qwen3.5, Qwen3-Next) over a flat ragged token array.

Per head, with a state S [K, V] per sequence, for each token t:

    S   = exp(g_t) * S                         (g_t <= 0: the gate's log decay)
    S   = S + k_t (beta_t * (v_t - S^T k_t))^T (the delta rule: write v_t at key k_t)
    o_t = S^T q_t

Tokens arrive as the attention layers see them: one flat [T] array, sequence boundaries
in `cu_q_lens` (prefill chunks and decodes side by side), each sequence starting from
its own state (`states [S, H, K, V]`, from the slot pool) and leaving its final one.

Two algorithms, the same function of their inputs:
* `gated_delta_rule_recurrent`: one token at a time (a `lax.scan` over T). The decode
  path, and the oracle's twin in JAX.
* `gated_delta_rule_chunked`: chunks of `chunk` tokens of one sequence each (a chunk
  never spans two sequences: `chunk_table`). Within a chunk the C sequential rank-one
  updates become matmuls: with G the chunk's cumulative log decay and
  L_ij = exp(G_i - G_j) (j <= i), the UT transform T = (I + strict_lower(beta_i k_i.k_j L_ij))^-1
  (a product of log2(C) matmul rounds, `unit_lower_inverse`) turns the delta corrections into U = T (beta v) and W = T (beta exp(G) k); then
    o     = exp(G) q S + (q k^T * L) (U - W S)
    S_out = exp(G_C) S + (exp(G_C - G) k)^T (U - W S)
  (the WY/UT form of the chunked delta rule, as in flash-linear-attention). Chunks are
  visited in order by a `lax.scan` carrying S; a sequence's first chunk starts from
  its slot's state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def token_sequences(cu_q_lens: jax.Array,  # [S+1] int32
                    num_seqs: jax.Array,  # [1] int32
                    num_tokens: int) -> jax.Array:  # [T] int32: each row's sequence, -1 for padding
    t = jnp.arange(num_tokens)
    seq = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    live = (seq < num_seqs[0]) & (t < cu_q_lens[num_seqs[0]])
    return jnp.where(live, seq, -1)


def chunk_table(cu_q_lens: jax.Array,  # [S+1] int32
                num_seqs: jax.Array,  # [1] int32
                num_tokens: int,
                chunk: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Cuts every live sequence into chunks of `chunk` tokens, in sequence order: returns
    rows [N, chunk] (token row, -1 past a sequence's end), seq [N] (the chunk's sequence,
    -1 for unused chunks) and first [N] (the sequence's first chunk). N = T // chunk + S,
    enough for any split of T tokens over S sequences."""
    s = cu_q_lens.shape[0] - 1
    n = num_tokens // chunk + s
    live = jnp.arange(s) < num_seqs[0]
    lens = jnp.where(live, jnp.diff(cu_q_lens), 0)
    per_seq = -(-lens // chunk)  # [S]
    ends = jnp.cumsum(per_seq)
    c = jnp.arange(n)
    seq = jnp.searchsorted(ends, c, side="right").astype(jnp.int32)
    used = c < ends[-1]
    seq_c = jnp.clip(seq, 0, s - 1)
    j = c - (ends[seq_c] - per_seq[seq_c])  # chunk index within its sequence
    start = cu_q_lens[seq_c] + j * chunk
    rows = start[:, None] + jnp.arange(chunk)[None, :]
    rows = jnp.where(used[:, None] & (rows < cu_q_lens[seq_c + 1][:, None]), rows, -1)
    return rows.astype(jnp.int32), jnp.where(used, seq_c, -1), used & (j == 0)


def gated_delta_rule_recurrent(q: jax.Array,  # [T, H, K]
                               k: jax.Array,  # [T, H, K]
                               v: jax.Array,  # [T, H, V]
                               g: jax.Array,  # [T, H] log decay (<= 0)
                               beta: jax.Array,  # [T, H]
                               cu_q_lens: jax.Array,  # [S+1] int32
                               num_seqs: jax.Array,  # [1] int32
                               states: jax.Array,  # [S, H, K, V] each sequence's state before its rows
                               ) -> tuple[jax.Array, jax.Array]:  # o [T, H, V], states [S, H, K, V]
    f32 = jnp.float32
    seq = token_sequences(cu_q_lens, num_seqs, q.shape[0])
    first = (seq >= 0) & (jnp.arange(q.shape[0]) == cu_q_lens[jnp.clip(seq, 0)])

    def step(carry, x):
        state, out_states = carry
        qt, kt, vt, gt, bt, s, is_first = x
        sc = jnp.clip(s, 0)
        state = jnp.where(is_first, out_states[sc].astype(f32), state)
        state = state * jnp.exp(gt)[:, None, None]
        delta = bt[:, None] * (vt - jnp.einsum("hkv,hk->hv", state, kt))
        state = state + kt[:, :, None] * delta[:, None, :]
        o = jnp.einsum("hkv,hk->hv", state, qt)
        out_states = jnp.where(s >= 0, out_states.at[sc].set(state.astype(out_states.dtype)), out_states)
        return (state, out_states), o

    xs = (q.astype(f32), k.astype(f32), v.astype(f32), g.astype(f32), beta.astype(f32), seq, first)
    init = (jnp.zeros(states.shape[1:], f32), states)
    (_, states), o = jax.lax.scan(step, init, xs)
    return jnp.where((seq >= 0)[:, None, None], o, 0).astype(v.dtype), states


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
    f32 = jnp.float32
    t = q.shape[0]
    rows, seq, first = chunk_table(cu_q_lens, num_seqs, t, chunk)
    valid = rows >= 0
    take = lambda x: jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 1)),
                               jnp.take(x.astype(f32), jnp.clip(rows, 0), axis=0), 0.0)

    xs = (take(q), take(k), take(v), take(g), take(beta))  # [N, C, ...] each

    def step(c, carry):  # chunk c of the used ones: a while loop, so unused chunks cost nothing
        state, out_states, o_all = carry
        s, is_first = seq[c], first[c]
        state = jnp.where(is_first, out_states[s].astype(f32), state)
        o, state = _chunk(state, *(x[c] for x in xs))
        out_states = out_states.at[s].set(state.astype(out_states.dtype))
        return state, out_states, o_all.at[c].set(o)

    o_all = jnp.zeros(rows.shape + v.shape[1:], f32)  # [N, C, H, V]
    init = (jnp.zeros(states.shape[1:], f32), states, o_all)
    _, states, o = jax.lax.fori_loop(0, jnp.sum(seq >= 0), step, init)
    flat_rows = jnp.where(valid, rows, t).reshape(-1)  # unused slots scatter past the end (dropped)
    out = jnp.zeros((t,) + o.shape[2:], f32).at[flat_rows].set(o.reshape((-1,) + o.shape[2:]), mode="drop")
    return out.astype(v.dtype), states
