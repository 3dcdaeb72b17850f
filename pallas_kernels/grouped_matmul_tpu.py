"""Grouped matmul for TPU in Pallas (models/grouped_matmul.py's contract): rows sorted by
group, each group through its own weight, rows past the groups 0.

Schedule (the megablox idea, our code): the rows in tiles of `tm`; the grid visits the
(group, row tile) pairs that overlap, group by group, so a tile shared by two groups is
visited twice in a row and its output block stays in VMEM between the visits. At most
tiles + groups - 1 visits; the grid has that many, and the visits past the real count
repeat the last one and compute nothing. Grid (N tiles, visits, K tiles): the K axis
reduces into an f32 scratch, and the last K step writes the group's own rows of the
block (a select: the other rows keep what the other group's visit wrote). Rows of a
visited tile that no group owns hold whatever the block held; the wrapper zeroes every
row past the groups.

Off TPU the kernel runs under the TPU interpreter (tests/test_grouped_matmul.py, small
shapes); tests/test_kernel_lowering.py lowers it for TPU with jax.export. Never compiled
or timed on a TPU: the engine's `auto` keeps `ragged_dot` there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def block(dim: int, wanted: int) -> int:
    """The largest of wanted, wanted/2, ... (down to 128) dividing `dim`, else the whole dim
    (a block equal to the array's dim is always a legal TPU block)."""
    size = wanted
    while dim % size:
        size //= 2
        if size < 128:
            return dim
    return size


def visit_schedule(group_sizes: jax.Array,  # [G] int32
                   num_tiles: int, tm: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(group of each visit [V], row tile of each visit [V], real visit count [1]) with
    V = num_tiles + G - 1; visits past the count repeat the last real one."""
    g = group_sizes.shape[0]
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    first = starts // tm
    visits = jnp.where(group_sizes > 0, jnp.maximum(ends - 1, 0) // tm - first + 1, 0)
    done = jnp.cumsum(visits)
    total = done[-1]
    v = jnp.minimum(jnp.arange(num_tiles + g - 1), jnp.maximum(total - 1, 0))
    group = jnp.clip(jnp.searchsorted(done, v, side="right"), 0, g - 1).astype(jnp.int32)
    tile = (first[group] + v - (done[group] - visits[group])).astype(jnp.int32)
    return group, jnp.clip(tile, 0, num_tiles - 1), total.reshape(1).astype(jnp.int32)


def _kernel(groups_ref, tiles_ref, starts_ref, ends_ref, total_ref,  # scalar prefetch
            lhs_ref,  # [tm, tk]
            rhs_ref,  # [tk, tn]
            out_ref,  # [tm, tn]
            acc_ref,  # [tm, tn] f32 scratch
            *, tm: int, k_steps: int):
    v, k = pl.program_id(1), pl.program_id(2)

    @pl.when(v < total_ref[0])
    def _visit():
        @pl.when(k == 0)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        acc_ref[...] += jnp.dot(lhs_ref[...], rhs_ref[...], preferred_element_type=jnp.float32)

        @pl.when(k == k_steps - 1)
        def _():
            g = groups_ref[v]
            row = tiles_ref[v] * tm + jax.lax.broadcasted_iota(jnp.int32, acc_ref.shape, 0)
            mine = (row >= starts_ref[g]) & (row < ends_ref[g])
            out_ref[...] = jnp.where(mine, acc_ref[...].astype(out_ref.dtype), out_ref[...])


@functools.partial(jax.jit, static_argnames=("tm", "tk", "tn", "interpret"))
def grouped_matmul_tpu(lhs: jax.Array,  # [M, K], rows sorted by group
                       rhs: jax.Array,  # [G, K, N]
                       group_sizes: jax.Array,  # [G] int32, sum <= M
                       tm: int = 128, tk: int = 512, tn: int = 512,
                       interpret=None,  # None: the TPU interpreter off TPU
                       ) -> jax.Array:  # [M, N] in lhs's dtype
    m, kdim = lhs.shape
    g, _, n = rhs.shape
    tk, tn = block(kdim, tk), block(n, tn)
    if interpret is None:
        interpret = False if jax.default_backend() == "tpu" else pltpu.InterpretParams()
    tiles = -(-m // tm)
    padded = jnp.pad(lhs, ((0, tiles * tm - m), (0, 0)))
    ends = jnp.cumsum(group_sizes).astype(jnp.int32)
    starts = (ends - group_sizes).astype(jnp.int32)
    groups, row_tiles, total = visit_schedule(group_sizes, tiles, tm)
    k_steps = kdim // tk
    out = pl.pallas_call(
        functools.partial(_kernel, tm=tm, k_steps=k_steps),
        out_shape=jax.ShapeDtypeStruct((tiles * tm, n), lhs.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(n // tn, tiles + g - 1, k_steps),
            in_specs=[pl.BlockSpec((tm, tk), lambda j, v, k, gr, ti, *_: (ti[v], k)),
                      pl.BlockSpec((None, tk, tn), lambda j, v, k, gr, ti, *_: (gr[v], k, j))],
            out_specs=pl.BlockSpec((tm, tn), lambda j, v, k, gr, ti, *_: (ti[v], j)),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
    )(groups, row_tiles, starts, ends, total, padded, rhs)
    rows = jnp.arange(tiles * tm)[:, None]
    return jnp.where(rows < ends[-1], out, jnp.zeros((), out.dtype))[:m]
