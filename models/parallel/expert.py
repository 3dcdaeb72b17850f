"""Expert parallelism over 'expert': a MoE layer's experts split over it and their columns
over 'tensor'; each rank runs the (token, expert) pairs routed to its own experts and one
all-reduce sums the partial outputs (models/moe.py).
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import PartitionSpec as P

from jaxfill.models.sharding import EXPERT, SEQUENCE, TENSOR, context_mesh, free_axes, mesh_axis_size


def expert_parallel(experts: Callable,
                    x: jax.Array,  # [T, H], replicated over tensor and expert
                    weights: jax.Array,  # [T, k] f32
                    ids: jax.Array,  # [T, k] int32
                    params: dict,  # name -> the experts' stacked [E, ...] array (or None)
                    axes: dict,  # name -> its logical axes ('experts' first; 'moe_mlp' the split columns)
                    slots: jax.Array | None = None,  # [T] i32 each row's LoRA slot (models/lora.py), or None
                    ) -> jax.Array:  # [T, H] in x's dtype
    """Runs `experts(x, weights, ids, params, first_expert, lead) -> [T, H]` per device on
    its experts (split over 'expert') and their columns (over 'tensor'), rows split over
    'sequence', and sums the partial outputs with one all-reduce over expert x tensor.
    `lead` is true on one rank of each 'tensor' group: the rank that adds what must be
    added once per pair (an expert's output bias). Without those axes: first_expert=0.
    `slots` (LoRA) reach `experts` as its `slots=` keyword, split like the rows."""
    extra = {} if slots is None else {"slots": slots}
    mesh = context_mesh()
    mesh_axes = () if mesh is None else free_axes(mesh, EXPERT, TENSOR, SEQUENCE)
    if not mesh_axes:
        return experts(x, weights, ids, params, 0, True, **extra).astype(x.dtype)
    live = {name: a for name, a in params.items() if a is not None}

    def splits(axis, logical):  # the mesh axis when every param with `logical` splits evenly over it
        dims = [a.shape[axes[n].index(logical)] for n, a in live.items() if logical in axes[n]]
        return axis if axis in mesh_axes and all(d % mesh_axis_size(mesh, axis) == 0 for d in dims) else None

    ep, tp = splits(EXPERT, "experts"), splits(TENSOR, "moe_mlp")
    sp = SEQUENCE if SEQUENCE in mesh_axes and x.shape[0] % mesh_axis_size(mesh, SEQUENCE) == 0 else None
    reduce = tuple(a for a in (ep, tp) if a)
    to_mesh = {"experts": ep, "moe_mlp": tp}

    def local(x, weights, ids, params, extra):
        first = jax.lax.axis_index(ep) * next(iter(params.values())).shape[0] if ep else 0
        lead = jax.lax.axis_index(tp) == 0 if tp else True
        out = experts(x, weights, ids, params, first, lead, **extra).astype(x.dtype)
        return jax.lax.psum(out, reduce) if reduce else out

    rows = P(sp, None)
    specs = {n: P(*(to_mesh.get(a) for a in axes[n])) for n in live}
    return jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, specs, {k: P(sp) for k in extra}),
                         out_specs=rows, axis_names=set(mesh_axes), check_vma=False)(x, weights, ids, live, extra)
