"""Per-sequence recurrences over the flat ragged token array, the drivers every linear
layer's rule shares (the gated delta rule, Mamba2's SSD).

Tokens arrive as the attention layers see them: one flat [T] array, sequence boundaries
in `cu_q_lens` (prefill chunks and decodes side by side), padding rows after the
`num_seqs` live sequences. Each sequence starts from its own state (`states [S, ...]`,
read from the slot pool by the layer) and leaves its final one there. A rule supplies
a step per token, `fn(state, *row inputs) -> (out, state)`, and one per chunk of at most
`chunk` tokens of one sequence (the same with [C, ...] inputs).

* `scan_ragged`, what the rules run: every sequence with exactly one token in the step
  (a decode) takes the token step, all of them at once (`step_decodes`: one vmapped
  step over [S, ...]); the others go through the chunk loop (`scan_chunks`), whose
  chunk table leaves the decodes out, so a decode-only step runs no chunk at all and a
  decode never pays for a chunk of C rows.
* `scan_tokens`: one token at a time (a lax.scan over T), the oracle's twin.
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
                chunk: int,
                skip_decodes: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Cuts every live sequence (but the decodes, if `skip_decodes`) into chunks of `chunk`
    tokens, in sequence order: returns rows [N, chunk] (token row, -1 past a sequence's
    end), seq [N] (the chunk's sequence, -1 for unused chunks) and first [N] (the
    sequence's first chunk). N = T // chunk + S, enough for any split of T tokens over S
    sequences."""
    s = cu_q_lens.shape[0] - 1
    n = num_tokens // chunk + s
    live = jnp.arange(s) < num_seqs[0]
    lens = jnp.diff(cu_q_lens)
    lens = jnp.where(live & ~(skip_decodes & (lens == 1)), lens, 0)
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
    """One token at a time (a lax.scan over T): the oracle's twin."""
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


def decodes(cu_q_lens: jax.Array,  # [S+1] int32
            num_seqs: jax.Array,  # [1] int32
            num_tokens: int) -> jax.Array:  # [S] int32: a decode's one row, num_tokens for the others
    lens = jnp.diff(cu_q_lens)
    one = (jnp.arange(lens.shape[0]) < num_seqs[0]) & (lens == 1)
    return jnp.where(one, jnp.clip(cu_q_lens[:-1], 0, num_tokens - 1), num_tokens).astype(jnp.int32)


def step_decodes(step: Callable,  # (state f32, *row inputs) -> (out row, state)
                 xs: tuple,  # [T, ...] each
                 cu_q_lens: jax.Array,  # [S+1] int32
                 num_seqs: jax.Array,  # [1] int32
                 states: jax.Array,  # [S, ...]
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:  # out [S, ...] f32, states [S, ...], rows [S]
    """The token step for every decode at once: each sequence's row gathered, one step
    vmapped over [S, ...], the others' states kept. `rows` (T for non-decodes) says where
    each output goes: `out_all.at[rows].set(out, mode="drop")`. A step without decodes
    skips the pass over the states (lax.cond): prefill-only steps pay nothing for it."""
    t = xs[0].shape[0]
    rows = decodes(cu_q_lens, num_seqs, t)
    one = rows < t
    row_xs = tuple(jnp.take(x.astype(jnp.float32), jnp.minimum(rows, t - 1), axis=0) for x in xs)  # [S, ...]

    def stepped(states):
        o, new = jax.vmap(step)(states.astype(jnp.float32), *row_xs)
        return o, jnp.where(one.reshape((-1,) + (1,) * (states.ndim - 1)), new.astype(states.dtype), states)

    o_shape = jax.eval_shape(stepped, states)[0]
    o, new = jax.lax.cond(jnp.any(one), stepped, lambda st: (jnp.zeros(o_shape.shape, o_shape.dtype), st), states)
    return o, new, rows


def scan_ragged(token_step: Callable,  # (state f32, *row inputs) -> (out row, state)
                chunk_step: Callable,  # (state f32, *chunk inputs [C, ...]) -> (out [C, ...], state)
                xs: tuple,  # [T, ...] each
                cu_q_lens: jax.Array,  # [S+1] int32
                num_seqs: jax.Array,  # [1] int32
                states: jax.Array,  # [S, ...]
                chunk: int,
                out_shape: tuple,  # one row's output shape
                ) -> tuple[jax.Array, jax.Array]:  # out [T, *out_shape] f32 (zero on padding), states [S, ...]
    """Decodes by `step_decodes`, every longer sequence by the chunk loop."""
    o_dec, states, rows = step_decodes(token_step, xs, cu_q_lens, num_seqs, states)
    o, states = scan_chunks(chunk_step, xs, cu_q_lens, num_seqs, states, chunk, out_shape, skip_decodes=True)
    return o.at[rows].set(o_dec, mode="drop"), states


def scan_chunks(step: Callable,  # (state f32, *chunk inputs [C, ...]) -> (out [C, ...], state)
                xs: tuple,  # [T, ...] each
                cu_q_lens: jax.Array,  # [S+1] int32
                num_seqs: jax.Array,  # [1] int32
                states: jax.Array,  # [S, ...]
                chunk: int,
                out_shape: tuple,  # one row's output shape
                skip_decodes: bool = False,  # leave one-token sequences alone (scan_ragged steps them)
                ) -> tuple[jax.Array, jax.Array]:  # out [T, *out_shape] f32, states [S, ...]
    """Chunks of `chunk` tokens of one sequence each (`chunk_table`), visited in order by a
    loop carrying the state; a sequence's first chunk starts from its entry of `states`.
    Each chunk's rows are gathered and its output scattered inside the loop, so unused
    chunks cost nothing. Rows past a sequence's end reach `step` as zeros (a rule makes
    zeros a no-op)."""
    f32 = jnp.float32
    t = xs[0].shape[0]
    rows, seq, first = chunk_table(cu_q_lens, num_seqs, t, chunk, skip_decodes)
    xs = tuple(x.astype(f32) for x in xs)

    def body(c, carry):  # chunk c of the used ones
        state, out_states, o_all = carry
        s, is_first, r = seq[c], first[c], rows[c]
        state = jnp.where(is_first, out_states[s].astype(f32), state)
        o, state = step(state, *(x[0] for x in gather_chunks(xs, r[None])))  # [C, ...] each
        out_states = out_states.at[s].set(state.astype(out_states.dtype))
        return state, out_states, o_all.at[jnp.where(r >= 0, r, t)].set(o, mode="drop")

    o_all = jnp.zeros((t,) + tuple(out_shape), f32)
    init = (jnp.zeros(states.shape[1:], f32), states, o_all)
    _, states, o = jax.lax.fori_loop(0, jnp.sum(seq >= 0), body, init)
    return o, states


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
