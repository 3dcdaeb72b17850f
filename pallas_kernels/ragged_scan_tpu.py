"""The chunk loop of pallas_kernels/ragged_scan.py as a Pallas TPU kernel, the driver every
linear layer's TPU kernel shares (the gated delta rule, Mamba2's SSD).

A chunked rule splits into work every chunk does on its own and a short recurrence
between chunks. XLA does the first for all chunks at once (the rule's `prepare`, batched
over the chunk table); the kernel does the second (the rule's `step`): one grid row per
head, the chunks in order, each sequence's state carried in VMEM from its first chunk
(read from `states`) to its last (written back to its entry, aliased in place).
Decodes (one token in the step) never reach the kernel: XLA steps them all at once
(ragged_scan's `step_decodes`) before it, and the chunk table leaves them out. Each
sequence's entry of `states` is read and written through a block whose index comes from
the scalar-prefetched chunk table, so a sequence never sees another's state.

Off TPU it runs under the TPU interpreter (tests).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxfill.pallas_kernels.ragged_scan import chunk_table, gather_chunks, scatter_chunks, step_decodes


def _kernel(step, seq_ref, first_ref, used_ref,  # scalar prefetch: [N] int32 each, [1] int32
            state_in, *refs):  # the sequence's state [K, V]; one (chunk, head) block of each operand;
    # then o [C, V], the state out [K, V] and S [K, V] f32 VMEM
    *ins, o_ref, state_out, s_scratch = refs
    c = pl.program_id(1)

    @pl.when(c < used_ref[0])
    def _():
        @pl.when(first_ref[c] == 1)
        def _():
            s_scratch[...] = state_in[...]

        o, s = step(s_scratch[...], *(r[...] for r in ins))
        o_ref[...] = o
        s_scratch[...] = s
        state_out[...] = s

    @pl.when(used_ref[0] == 0)  # no live chunk: write back what was read, not an unwritten buffer
    def _():
        state_out[...] = state_in[...]


def scan_chunks_tpu(token_step: Callable,  # (state f32, *row inputs) -> (out row, state): the decodes, in XLA
                    prepare: Callable,  # (*xs as [N, C, ...] f32) -> operands, [N, H, ...] each
                    step: Callable,  # (state [K, V] f32, *one [...] block of each operand) -> (o [C, V], state)
                    xs: tuple,  # [T, ...] each, the rule's per-row inputs
                    cu_q_lens: jax.Array,  # [S+1] int32
                    num_seqs: jax.Array,  # [1] int32
                    states: jax.Array,  # [S, H, K, V]
                    chunk: int,
                    interpret=None,  # None: the TPU interpreter off TPU; False; or InterpretParams
                    ) -> tuple[jax.Array, jax.Array]:  # o [T, H, V] f32 (zero on padding), states [S, H, K, V] f32
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
        if interpret:
            interpret = pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")
    f32 = jnp.float32
    t = xs[0].shape[0]
    _, h, dk, dv = states.shape
    o_dec, states, dec_rows = step_decodes(token_step, xs, cu_q_lens, num_seqs, states)  # all decodes at once
    rows, seq, first = chunk_table(cu_q_lens, num_seqs, t, chunk, skip_decodes=True)  # [N, C], [N], [N]
    n = rows.shape[0]
    operands = prepare(*gather_chunks(xs, rows))
    used = jnp.sum(seq >= 0).astype(jnp.int32)
    # unused chunks point at the last used chunk's sequence: their blocks stay where they were
    seq_map = jnp.where(seq >= 0, seq, seq[jnp.maximum(used - 1, 0)]).astype(jnp.int32)
    seq_map = jnp.clip(seq_map, 0, states.shape[0] - 1)

    def chunk_block(*tail):  # one (chunk, head) block of an [N, H, ...] operand
        return pl.BlockSpec((None, None) + tail, lambda hh, cc, *_: (cc, hh) + (0,) * len(tail))

    state_block = pl.BlockSpec((None, None, dk, dv), lambda hh, cc, seq_r, *_: (seq_r[cc], hh, 0, 0))
    o, states = pl.pallas_call(
        functools.partial(_kernel, step),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(h, n),
            in_specs=[state_block] + [chunk_block(*x.shape[2:]) for x in operands],
            out_specs=[chunk_block(chunk, dv), state_block],
            scratch_shapes=[pltpu.VMEM((dk, dv), f32)],
        ),
        out_shape=[jax.ShapeDtypeStruct((n, h, chunk, dv), f32), jax.ShapeDtypeStruct(states.shape, f32)],
        input_output_aliases={3: 1},  # states (after the 3 prefetched scalars) in place
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
    )(seq_map, first.astype(jnp.int32), used[None], states.astype(f32), *operands)
    return scatter_chunks(o.transpose(0, 2, 1, 3), rows, t).at[dec_rows].set(o_dec, mode="drop"), states


def matmul(a: jax.Array, b: jax.Array) -> jax.Array:  # [M, K] @ [K, N] -> [M, N] f32, for a step
    return jnp.dot(a, b, preferred_element_type=jnp.float32)
