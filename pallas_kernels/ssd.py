"""Mamba2's selective state-space recurrence (SSD; Nemotron-H) over a flat ragged token array.

Per head h, with a state S [N, P] per sequence (the state axis first, as the gated delta
rule's [K, V]), for each token t with step dt_t > 0 and input x_t [P]:

    S   = exp(dt_t A_h) S + dt_t B_t x_t^T      (A_h < 0: the head's decay rate)
    y_t = S^T C_t + D_h x_t

B_t, C_t [N] come per group and are shared by the H / G heads of it. The step is
dt = softplus(dt_raw + dt_bias), clipped to the checkpoint's `time_step_limit`
(`time_steps`). Sequences, slots and padding as in pallas_kernels/ragged_scan.py.

Two algorithms, the same function of their inputs:
* `ssd_recurrent`: one token at a time; the oracle's twin.
* `ssd_chunked`: each decode by the per-token step, all decodes at once; every longer
  sequence in chunks of `chunk` tokens of one sequence (ragged_scan's `scan_ragged`
  does the split). With G_i the chunk's
  cumulative log decay (sum of dt A up to row i), every exponent below is <= 0:
    y     = (C B^T * exp(G_i - G_j) [j <= i] * dt_j) x + exp(G) C S + D x
    S_out = exp(G_last) S + (exp(G_last - G) dt B)^T x
  the intra-chunk part one decay-masked [C, C] matmul per head, the state passed
  between chunks by the loop.
The chunk-local terms (`chunk_terms`) are shared with ssd_tpu.py, where XLA computes
them for all chunks at once and a Pallas TPU kernel carries the state between chunks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxfill.pallas_kernels.ragged_scan import scan_ragged, scan_tokens


def time_steps(dt_raw: jax.Array,  # [T, H] the projection's output
               dt_bias: jax.Array,  # [H]
               limit: tuple[float, float] | None,  # (lo, hi) clip; None: (0, inf), none needed
               ) -> jax.Array:  # [T, H] f32, > 0
    dt = jax.nn.softplus(dt_raw.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    return dt if limit is None else jnp.clip(dt, limit[0], limit[1])


def _by_head(groups: jax.Array, heads: int) -> jax.Array:  # [..., G, N] -> [..., H, N]
    return jnp.repeat(groups, heads // groups.shape[-2], axis=-2)


def token_step(a: jax.Array, d: jax.Array):  # a, d [H] f32
    def step(state, x, dt, b, c):  # state [H, N, P]; x [H, P], dt [H], b, c [G, N]
        """The old state read once, the new one written once (a decode is bound by the
        state's bytes): y = S'^T c = exp(dt a) S^T c + dt (b.c) x, plus D x."""
        h = x.shape[0]
        b, c = _by_head(b, h), _by_head(c, h)  # [H, N]
        decay = jnp.exp(dt * a)[:, None]  # [H, 1]
        skip = dt[:, None] * jnp.sum(b * c, axis=-1, keepdims=True) + d[:, None]  # [H, 1]
        y = decay * jnp.einsum("hnp,hn->hp", state, c) + skip * x
        return y, state * decay[:, :, None] + (dt[:, None] * b)[:, :, None] * x[:, None, :]
    return step


def chunk_terms(x: jax.Array,  # [C, H, P] (rows past the sequence's end zero: no decay, no write)
                dt: jax.Array,  # [C, H]
                a: jax.Array,  # [H] f32
                b: jax.Array,  # [C, G, N]
                c: jax.Array,  # [C, G, N]
                d: jax.Array,  # [H] f32
                ) -> tuple:  # heads first: y_free [H, C, P], c_in [H, C, N], write [H, C, N], decay [H], x [H, C, P]
    """One chunk's state-free terms: its output from its own rows (y_free), the readout of
    the incoming state (y = y_free + c_in S), and the state update (S = decay S + write^T x)."""
    n, h = x.shape[0], x.shape[1]
    g = jnp.cumsum(dt * a, axis=0).T  # [H, C] cumulative log decay
    lower = jnp.tril(jnp.ones((n, n), bool))
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, g[:, :, None] - g[:, None, :], 0.0)), 0.0)  # [H, C, C]
    cb = jnp.einsum("ign,jgn->gij", c, b)  # [G, C, C]
    cb = jnp.repeat(cb, h // cb.shape[0], axis=0)  # [H, C, C]
    xh = x.transpose(1, 0, 2)  # [H, C, P]
    bh, ch = _by_head(b, h).transpose(1, 0, 2), _by_head(c, h).transpose(1, 0, 2)  # [H, C, N]
    y_free = jnp.einsum("hij,hjp->hip", cb * decay * dt.T[:, None, :], xh) + d[:, None, None] * xh
    last = g[:, -1]  # [H]
    write = bh * (jnp.exp(last[:, None] - g) * dt.T)[:, :, None]
    return y_free, ch * jnp.exp(g)[:, :, None], write, jnp.exp(last), xh


def _chunk_step(a: jax.Array, d: jax.Array):  # a, d [H] f32
    def step(state,  # [H, N, P] f32
             x, dt, b, c,  # one chunk's: [C, H, P], [C, H], [C, G, N] each
             ):  # -> y [C, H, P], state [H, N, P]
        y_free, c_in, write, decay, xh = chunk_terms(x, dt, a, b, c, d)
        y = y_free + jnp.einsum("hcn,hnp->hcp", c_in, state)
        state = state * decay[:, None, None] + jnp.einsum("hcn,hcp->hnp", write, xh)
        return y.transpose(1, 0, 2), state
    return step


def ssd_recurrent(x: jax.Array,  # [T, H, P]
                  dt: jax.Array,  # [T, H] time steps (time_steps)
                  a: jax.Array,  # [H] A = -exp(A_log) < 0
                  b: jax.Array,  # [T, G, N]
                  c: jax.Array,  # [T, G, N]
                  d: jax.Array,  # [H] skip weight
                  cu_q_lens: jax.Array,  # [S+1] int32
                  num_seqs: jax.Array,  # [1] int32
                  states: jax.Array,  # [S, H, N, P] each sequence's state before its rows
                  ) -> tuple[jax.Array, jax.Array]:  # y [T, H, P] f32, states [S, H, N, P]
    f32 = jnp.float32
    return scan_tokens(token_step(a.astype(f32), d.astype(f32)), (x, dt, b, c), cu_q_lens, num_seqs, states)


@functools.partial(jax.jit, static_argnames=("chunk",))
def ssd_chunked(x: jax.Array,  # [T, H, P]
                dt: jax.Array,  # [T, H]
                a: jax.Array,  # [H]
                b: jax.Array,  # [T, G, N]
                c: jax.Array,  # [T, G, N]
                d: jax.Array,  # [H]
                cu_q_lens: jax.Array,  # [S+1] int32
                num_seqs: jax.Array,  # [1] int32
                states: jax.Array,  # [S, H, N, P]
                chunk: int = 64,
                ) -> tuple[jax.Array, jax.Array]:  # y [T, H, P] f32, states [S, H, N, P]
    f32 = jnp.float32
    a, d = a.astype(f32), d.astype(f32)
    return scan_ragged(token_step(a, d), _chunk_step(a, d), (x, dt, b, c), cu_q_lens, num_seqs, states,
                       chunk, x.shape[1:])
