"""Grouped matmul: rows sorted by group, each group through its own weight.

    out[r] = lhs[r] @ rhs[g]   for the rows r of group g (groups one after another from
                               row 0, `group_sizes` long); rows past the groups: 0.

Three implementations. `pallas_tpu` is our Pallas TPU kernel
(pallas_kernels/grouped_matmul_tpu.py; interpreter-checked and lowered for TPU, never run
on one, so `auto` does not pick it). `ragged_dot` is XLA's `jax.lax.ragged_dot`: TPU lowers it to a
grouped kernel, but XLA:CPU lowers it densely (every row through every group's weight,
masked: G times the FLOPs). `tiled` is ours, for those backends: the rows in tiles of
`tile`, a loop over the (group, tile) pairs that overlap (at most tiles + groups - 1 of
them, the megablox schedule), each one [tile, K] @ [K, N] matmul whose rows outside the
group are dropped by a select. Its FLOPs are those of the rows plus at most one partial
tile per group boundary (benchmarks/moe_cpu.py measures both).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLS = ("auto", "ragged_dot", "tiled", "pallas_tpu")
TILE = 128


def grouped_matmul(lhs: jax.Array,  # [M, K], rows sorted by group
                   rhs: jax.Array,  # [G, K, N]
                   group_sizes: jax.Array,  # [G] int32, sum <= M
                   impl: str = "auto",
                   tile: int = TILE,
                   ) -> jax.Array:  # [M, N] in lhs's dtype
    if impl == "auto":
        impl = "ragged_dot" if jax.default_backend() == "tpu" else "tiled"
    if impl == "ragged_dot":
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)
    if impl == "pallas_tpu":  # ours; runs in the TPU interpreter off TPU (slow: tests only)
        from jaxfill.pallas_kernels.grouped_matmul_tpu import grouped_matmul_tpu

        return grouped_matmul_tpu(lhs, rhs, group_sizes)
    if impl != "tiled":
        raise ValueError(f"grouped matmul impl must be one of {IMPLS}, got {impl!r}")
    return tiled_grouped_matmul(lhs, rhs, group_sizes, tile)


def tiled_grouped_matmul(lhs: jax.Array,  # [M, K]
                         rhs: jax.Array,  # [G, K, N]
                         group_sizes: jax.Array,  # [G] int32
                         tile: int = TILE,
                         ) -> jax.Array:  # [M, N]
    """A loop over the groups, each over the tiles its rows touch (none for an empty
    group): a group's weight is sliced once, each tile is one [tile, K] @ [K, N] matmul,
    and a select keeps the group's own rows of it (a tile shared with the next group is
    visited again). Rows past the groups are never visited and stay 0."""
    m, _ = lhs.shape
    groups, _, n = rhs.shape
    tile = min(tile, max(8, 1 << (m - 1).bit_length()))
    tiles = -(-m // tile)
    padded = jnp.pad(lhs, ((0, tiles * tile - m), (0, 0)))
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes

    def per_group(g, out):
        weight = rhs[g]  # [K, N]
        first = starts[g] // tile
        last = jnp.where(group_sizes[g] > 0, (ends[g] - 1) // tile, first - 1)

        def per_tile(t, out):
            rows = jax.lax.dynamic_slice_in_dim(padded, t * tile, tile)  # [tile, K]
            y = jnp.dot(rows, weight, preferred_element_type=jnp.float32)  # [tile, N]
            index = t * tile + jnp.arange(tile)
            mine = (index >= starts[g]) & (index < ends[g])
            kept = jnp.where(mine[:, None], y, jax.lax.dynamic_slice_in_dim(out, t * tile, tile))
            return jax.lax.dynamic_update_slice_in_dim(out, kept, t * tile, 0)

        return jax.lax.fori_loop(first, last + 1, per_tile, out)

    out = jax.lax.fori_loop(0, groups, per_group, jnp.zeros((tiles * tile, n), jnp.float32))
    return out[:m].astype(lhs.dtype)
