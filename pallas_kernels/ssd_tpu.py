"""Mamba2's chunked SSD scan with its sequential part as a Pallas TPU kernel.

The chunked form (pallas_kernels/ssd.py) splits into work every chunk does on its own,
which XLA does for all chunks at once (ssd.chunk_terms over the chunk table: the
decay-masked C B^T x and D x, the decayed C and B), and the recurrence between chunks,
which the shared driver (pallas_kernels/ragged_scan_tpu.py) runs in VMEM. Per chunk and
head, with S the [N, P] state:

    y = y_free + (exp(G) C) S,   S = exp(G_last) S + (exp(G_last - G) dt B)^T x

`auto` keeps the XLA loop until a TPU measurement says otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxfill.pallas_kernels.ragged_scan_tpu import matmul, scan_chunks_tpu
from jaxfill.pallas_kernels.ssd import token_step, chunk_terms


def _prepare(a, d):  # a, d [H] f32
    def prepare(x, dt, b, c):  # [N, C, ...] f32 each -> per chunk, heads second: [N, H, ...]
        y_free, c_in, write, decay, xh = jax.vmap(chunk_terms, in_axes=(0, 0, None, 0, 0, None))(x, dt, a, b, c, d)
        return y_free, c_in, write.transpose(0, 1, 3, 2), xh, decay[..., None, None]  # write^T [N, H, N, C]
    return prepare


def _step(s, y_free, c_in, write_t, x, decay):  # S [N, P] f32; one (chunk, head) block of each of prepare's
    return y_free + matmul(c_in, s), s * decay + matmul(write_t, x)


@functools.partial(jax.jit, static_argnames=("chunk", "interpret"))
def ssd_tpu(x: jax.Array,  # [T, H, P]
            dt: jax.Array,  # [T, H] time steps (ssd.time_steps)
            a: jax.Array,  # [H] A = -exp(A_log) < 0
            b: jax.Array,  # [T, G, N]
            c: jax.Array,  # [T, G, N]
            d: jax.Array,  # [H] skip weight
            cu_q_lens: jax.Array,  # [S+1] int32
            num_seqs: jax.Array,  # [1] int32
            states: jax.Array,  # [S, H, N, P]
            chunk: int = 64,
            interpret=None,  # None: the TPU interpreter off TPU; False; or InterpretParams
            ) -> tuple[jax.Array, jax.Array]:  # y [T, H, P] f32, states [S, H, N, P] f32
    f32 = jnp.float32
    a, d = a.astype(f32), d.astype(f32)
    return scan_chunks_tpu(token_step(a, d), _prepare(a, d), _step, (x, dt, b, c), cu_q_lens, num_seqs,
                           states, chunk, interpret)
