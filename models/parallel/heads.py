"""Head parallelism for mixers whose heads never talk to each other (Gated DeltaNet,
Mamba2): the layer runs per 'tensor' rank on its heads, in a shard_map.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import PartitionSpec as P

from jaxfill.models.sharding import TENSOR, context_mesh, free_axes, mesh_axis_size


def split_over_heads(fn: Callable, args: tuple, in_axes: tuple, out_axes) -> Any:
    """Runs fn(*args) per 'tensor' rank on its heads: each subtree of `args` is split over
    'tensor' on the axis `in_axes` names for it (None: replicated), and the outputs are
    joined on `out_axes` (a prefix tree of fn's output). A layer whose heads never talk to
    each other (a linear-attention mixer) runs as it would on one device. Without a mesh,
    or with tensor = 1: fn(*args)."""
    mesh = context_mesh()
    if mesh is None or TENSOR not in free_axes(mesh, TENSOR) or mesh_axis_size(mesh, TENSOR) == 1:
        return fn(*args)

    def specs(axes, tree):
        def one(axis, sub):
            return jax.tree.map(lambda leaf: P() if axis is None else
                                P(*[TENSOR if i == axis else None for i in range(leaf.ndim)]), sub)
        return jax.tree.map(one, axes, tree, is_leaf=lambda x: x is None)

    out_shapes = jax.eval_shape(fn, *args)
    return jax.shard_map(fn, mesh=mesh, in_specs=specs(in_axes, args), out_specs=specs(out_axes, out_shapes),
                         axis_names={TENSOR}, check_vma=False)(*args)
