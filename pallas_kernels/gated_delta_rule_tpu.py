"""The chunked gated delta rule with its sequential part as a Pallas TPU kernel.

The WY/UT form (pallas_kernels/gated_delta_rule.py) splits into work every chunk does on
its own and a short recurrence between chunks. XLA does the first for all chunks at once
(batched matmuls: the cumulative decay, the UT inverse, U, W, the masked q k^T); the
kernel does the second: one grid row per head, the chunks in order, each sequence's
[K, V] state carried in VMEM from its first chunk (read from `states`) to its last
(written back to its entry, aliased in place). Per chunk, with S the state:

    new_v = U - W S,   o = (exp(G) q) S + (q k^T * L) new_v,   S = exp(G_C) S + k_out^T new_v

Each sequence's entry of `states` is read and written through a block whose index comes
from the scalar-prefetched chunk table, so a sequence never sees another's state.
Decodes (one token in the step) never reach the kernel: XLA steps them all at once
(ragged_scan's `step_decodes`) before it, and the chunk table leaves them out.
Off TPU it runs under the TPU interpreter (tests); `auto` keeps the XLA loop until a TPU
measurement says otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxfill.pallas_kernels.gated_delta_rule import token_step, unit_lower_inverse
from jaxfill.pallas_kernels.ragged_scan import chunk_table, gather_chunks, scatter_chunks, step_decodes


def _prepare(q, k, v, g, beta):  # [N, C, H, ...] f32 each -> per chunk, heads second: [N, H, ...]
    """Every chunk's state-free terms at once."""
    c = q.shape[1]
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # [N, H, C, .]
    g, beta = g.transpose(0, 2, 1), beta.transpose(0, 2, 1)  # [N, H, C]
    big_g = jnp.cumsum(g, axis=-1)
    lower = jnp.tril(jnp.ones((c, c), bool))
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, big_g[..., :, None] - big_g[..., None, :], 0.0)), 0.0)
    kk = jnp.einsum("nhik,nhjk->nhij", k, k) * decay * beta[..., None]
    t = unit_lower_inverse(jnp.where(jnp.tril(lower, -1), kk, 0.0))
    u = jnp.einsum("nhij,nhjv->nhiv", t, v * beta[..., None])
    w = jnp.einsum("nhij,nhjk->nhik", t, k * (beta * jnp.exp(big_g))[..., None])
    qk = jnp.einsum("nhik,nhjk->nhij", q, k) * decay
    qg = q * jnp.exp(big_g)[..., None]
    last = big_g[..., -1:]  # [N, H, 1]
    k_out_t = (k * jnp.exp(last - big_g)[..., None]).transpose(0, 1, 3, 2)  # [N, H, K, C]
    return u, w, qk, qg, k_out_t, jnp.exp(last)[..., None]  # the last: [N, H, 1, 1]


def _kernel(seq_ref, first_ref, used_ref,  # scalar prefetch: [N] int32 each, [1] int32
            state_in, u_ref, w_ref, qk_ref, qg_ref, k_out_ref, dec_ref,  # blocks of one (chunk, head)
            o_ref, state_out, s_scratch):  # o [C, V], the sequence's state [K, V], S [K, V] f32 VMEM
    c = pl.program_id(1)

    @pl.when((c == 0) & (used_ref[0] == 0))  # no chunk at all: the block written back must hold its input
    def _():
        state_out[...] = state_in[...]

    @pl.when(c < used_ref[0])
    def _():
        @pl.when(first_ref[c] == 1)
        def _():
            s_scratch[...] = state_in[...]

        s = s_scratch[...]
        dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32)
        new_v = u_ref[...] - dot(w_ref[...], s)
        o_ref[...] = dot(qg_ref[...], s) + dot(qk_ref[...], new_v)
        s = s * dec_ref[...] + dot(k_out_ref[...], new_v)
        s_scratch[...] = s
        state_out[...] = s


@functools.partial(jax.jit, static_argnames=("chunk", "interpret"))
def gated_delta_rule_tpu(q: jax.Array,  # [T, H, K]
                         k: jax.Array,  # [T, H, K]
                         v: jax.Array,  # [T, H, V]
                         g: jax.Array,  # [T, H] log decay (<= 0)
                         beta: jax.Array,  # [T, H]
                         cu_q_lens: jax.Array,  # [S+1] int32
                         num_seqs: jax.Array,  # [1] int32
                         states: jax.Array,  # [S, H, K, V] f32
                         chunk: int = 64,
                         interpret=None,  # None: the TPU interpreter off TPU; False; or InterpretParams
                         ) -> tuple[jax.Array, jax.Array]:  # o [T, H, V], states [S, H, K, V]
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
        if interpret:
            interpret = pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")
    f32 = jnp.float32
    t, h, dk = q.shape
    dv = v.shape[-1]
    o_dec, states, dec_rows = step_decodes(token_step, (q, k, v, g, beta), cu_q_lens, num_seqs, states)
    rows, seq, first = chunk_table(cu_q_lens, num_seqs, t, chunk, skip_decodes=True)  # [N, C], [N], [N]
    n = rows.shape[0]
    u, w, qk, qg, k_out_t, dec = _prepare(*gather_chunks((q, k, v, g, beta), rows))
    used = jnp.sum(seq >= 0).astype(jnp.int32)
    # unused chunks point at the last used chunk's sequence: their blocks stay where they were
    seq_map = jnp.where(seq >= 0, seq, seq[jnp.maximum(used - 1, 0)]).astype(jnp.int32)
    seq_map = jnp.clip(seq_map, 0, states.shape[0] - 1)

    def chunk_block(*tail):  # one (chunk, head) block of an [N, H, ...] operand
        return pl.BlockSpec((None, None) + tail, lambda hh, cc, *_: (cc, hh) + (0,) * len(tail))

    state_block = pl.BlockSpec((None, None, dk, dv), lambda hh, cc, seq_r, *_: (seq_r[cc], hh, 0, 0))
    o, states = pl.pallas_call(
        _kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(h, n),
            in_specs=[state_block, chunk_block(chunk, dv), chunk_block(chunk, dk), chunk_block(chunk, chunk),
                      chunk_block(chunk, dk), chunk_block(dk, chunk), chunk_block(1, 1)],
            out_specs=[chunk_block(chunk, dv), state_block],
            scratch_shapes=[pltpu.VMEM((dk, dv), f32)],
        ),
        out_shape=[jax.ShapeDtypeStruct((n, h, chunk, dv), f32), jax.ShapeDtypeStruct(states.shape, f32)],
        input_output_aliases={3: 1},  # states (after the 3 prefetched scalars) in place
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
    )(seq_map, first.astype(jnp.int32), used[None], states.astype(f32), u, w, qk, qg, k_out_t, dec)
    o = scatter_chunks(o.transpose(0, 2, 1, 3), rows, t).at[dec_rows].set(o_dec, mode="drop")
    return o.astype(v.dtype), states
