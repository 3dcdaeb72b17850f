"""Per-sequence recurrences over the flat ragged token array, the drivers every linear
layer's rule shares (the gated delta rule, Mamba2's SSD).

Tokens arrive as the attention layers see them: one flat [T] array, sequence boundaries
in `cu_q_lens` (prefill chunks and decodes side by side), padding rows after the
`num_seqs` live sequences. Each sequence starts from its own state (`states [S, ...]`,
read from the slot pool by the layer) and leaves its final one there. A rule supplies
one step, `fn(state, *inputs) -> (out, state)`, either per token (`scan_tokens`) or per
chunk of at most `chunk` tokens of one sequence (`scan_chunks`).
"""

from __future__ import annotations

from typing import Callable

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


def scan_tokens(step: Callable,  # (state f32, *row inputs) -> (out row, state)
                xs: tuple,  # [T, ...] each, the step's per-row inputs
                cu_q_lens: jax.Array,  # [S+1] int32
                num_seqs: jax.Array,  # [1] int32
                states: jax.Array,  # [S, ...] each sequence's state before its rows
                ) -> tuple[jax.Array, jax.Array]:  # out [T, ...] f32 (zero on padding), states [S, ...]
    """One token at a time (a lax.scan over T): the decode path, and the oracle's twin."""
    f32 = jnp.float32
    t = xs[0].shape[0]
    seq = token_sequences(cu_q_lens, num_seqs, t)
    first = (seq >= 0) & (jnp.arange(t) == cu_q_lens[jnp.clip(seq, 0)])

    def body(carry, inp):
        state, out_states = carry
        x, s, is_first = inp
        sc = jnp.clip(s, 0)
        state = jnp.where(is_first, out_states[sc].astype(f32), state)
        o, state = step(state, *x)
        out_states = jnp.where(s >= 0, out_states.at[sc].set(state.astype(out_states.dtype)), out_states)
        return (state, out_states), o

    init = (jnp.zeros(states.shape[1:], f32), states)
    (_, states), o = jax.lax.scan(body, init, (tuple(x.astype(f32) for x in xs), seq, first))
    return jnp.where((seq >= 0).reshape((-1,) + (1,) * (o.ndim - 1)), o, 0.0), states


def scan_chunks(step: Callable,  # (state f32, *chunk inputs [C, ...]) -> (out [C, ...], state)
                xs: tuple,  # [T, ...] each
                cu_q_lens: jax.Array,  # [S+1] int32
                num_seqs: jax.Array,  # [1] int32
                states: jax.Array,  # [S, ...]
                chunk: int,
                out_shape: tuple,  # one row's output shape
                ) -> tuple[jax.Array, jax.Array]:  # out [T, *out_shape] f32, states [S, ...]
    """Chunks of `chunk` tokens of one sequence each (`chunk_table`), visited in order by a
    loop carrying the state; a sequence's first chunk starts from its entry of `states`.
    Rows past a sequence's end reach `step` as zeros (a rule makes zeros a no-op)."""
    f32 = jnp.float32
    t = xs[0].shape[0]
    rows, seq, first = chunk_table(cu_q_lens, num_seqs, t, chunk)
    xs = gather_chunks(xs, rows)  # [N, C, ...] each

    def body(c, carry):  # chunk c of the used ones: a while loop, so unused chunks cost nothing
        state, out_states, o_all = carry
        s, is_first = seq[c], first[c]
        state = jnp.where(is_first, out_states[s].astype(f32), state)
        o, state = step(state, *(x[c] for x in xs))
        out_states = out_states.at[s].set(state.astype(out_states.dtype))
        return state, out_states, o_all.at[c].set(o)

    o_all = jnp.zeros(rows.shape + tuple(out_shape), f32)  # [N, C, ...]
    init = (jnp.zeros(states.shape[1:], f32), states, o_all)
    _, states, o = jax.lax.fori_loop(0, jnp.sum(seq >= 0), body, init)
    return scatter_chunks(o, rows, t), states


def gather_chunks(xs: tuple,  # [T, ...] each
                  rows: jax.Array,  # [N, C] int32 (chunk_table; -1 past a sequence's end)
                  ) -> tuple:  # [N, C, ...] f32 each, zero where rows < 0
    valid = rows >= 0
    return tuple(jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 1)),
                           jnp.take(x.astype(jnp.float32), jnp.clip(rows, 0), axis=0), 0.0) for x in xs)


def scatter_chunks(o: jax.Array,  # [N, C, ...] per chunk row
                   rows: jax.Array,  # [N, C] int32 (chunk_table)
                   num_tokens: int) -> jax.Array:  # [T, ...] f32, zero on rows no chunk holds
    flat_rows = jnp.where(rows >= 0, rows, num_tokens).reshape(-1)  # unused slots scatter past the end (dropped)
    shape = o.shape[2:]
    return jnp.zeros((num_tokens,) + shape, jnp.float32).at[flat_rows].set(o.reshape((-1,) + shape), mode="drop")
