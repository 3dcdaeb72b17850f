"""Params built straight into their shards on a mesh (the KV cache: KVCache.create(mesh=)).

No parameter is ever whole on one device: random init compiles with `out_shardings`, and
a checkpoint tensor reaches each device as that device's slice, read from the file by the
process that owns the device (`shard_placer`). The rules (which logical axis goes to
which mesh axis) are models/sharding.py's.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
from flax import nnx

from jaxfill.models.checkpoint import TensorSlices
from jaxfill.models.execution_plan import ExecutionPlan
from jaxfill.models.families.registry import new_model
from jaxfill.models.sharding import param_shardings, var_sharding


def abstract_state(config, attention_impl: str = "auto", plan: ExecutionPlan = ExecutionPlan()):
    """(graphdef, abstract state) of the config's model, without allocating anything."""
    model = nnx.eval_shape(lambda: new_model(config, nnx.Rngs(0), attention_impl=attention_impl, plan=plan))
    return nnx.split(model)


def init_sharded(config, mesh: jax.sharding.Mesh, attention_impl: str = "auto",
                 rules: Mapping[str, Any] | None = None, plan: ExecutionPlan | None = None):
    """Random init straight into shards (jit with out_shardings): (graphdef, state).
    Bitwise the same values as `new_model(config)` (threefry is partitionable). `plan`
    None: the unrolled layout on this mesh (ExecutionPlan.unrolled_on)."""
    plan = plan or ExecutionPlan.unrolled_on(mesh)
    graphdef, abstract = abstract_state(config, attention_impl, plan)
    shardings = param_shardings(abstract, mesh, rules)

    def init():
        return nnx.split(new_model(config, nnx.Rngs(config.seed), attention_impl=attention_impl, plan=plan))[1]

    with jax.set_mesh(mesh):
        state = jax.jit(init, out_shardings=shardings)()
    return graphdef, state


def shard_placer(mesh: jax.sharding.Mesh, abstract: nnx.State,
                 rules: Mapping[str, Any] | None = None) -> Callable[[tuple, TensorSlices], jax.Array]:
    """`place(path, tensor)` for models.checkpoint.load_hf_params.

    `jax.make_array_from_callback` asks only for the slices of this process's devices, and
    each slice is read from the file on its own (TensorSlices.read), so a process reads
    and holds only what its devices hold; a slice several local devices share (a
    replicated param) is read once."""
    flat = dict(nnx.to_flat_state(abstract))

    def place(path: tuple, tensor: TensorSlices) -> jax.Array:
        sharding = var_sharding(flat[tuple(path)], mesh, rules)
        read: dict[tuple, Any] = {}

        def slice_of(index: tuple):
            key = tuple((s.start, s.stop, s.step) for s in index)
            if key not in read:
                read[key] = tensor.read(index)
            return read[key]

        return jax.make_array_from_callback(tensor.shape, sharding, slice_of)
    return place
