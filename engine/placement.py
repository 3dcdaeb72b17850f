"""Params and KV cache built straight into their shards on a mesh.

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
from jaxfill.models.kv_cache import KVCache, cache_entry, kv_storage_dtype
from jaxfill.models.llama import Llama
from jaxfill.models.sharding import (DATA, KV_CACHE_AXES, kv_cache_heads, kv_cache_sharding, param_shardings,
                                     var_sharding)
from jaxfill.pallas_kernels import QuantizedPages, init_kv_pages, init_quantized_pages


def abstract_state(config, attention_impl: str = "auto", stages: int = 1, microbatches: int = 1):
    """(graphdef, abstract state) of a Llama, without allocating anything."""
    model = nnx.eval_shape(lambda: Llama(config, nnx.Rngs(0), attention_impl=attention_impl,
                                         stages=stages, microbatches=microbatches))
    return nnx.split(model)


def init_sharded(config, mesh: jax.sharding.Mesh, attention_impl: str = "auto",
                 rules: Mapping[str, Any] | None = None, stages: int = 1, microbatches: int = 1):
    """Random init straight into shards (jit with out_shardings): (graphdef, state).
    Bitwise the same values as `Llama(config)` (threefry is partitionable)."""
    graphdef, abstract = abstract_state(config, attention_impl, stages, microbatches)
    shardings = param_shardings(abstract, mesh, rules)

    def init():
        return nnx.split(Llama(config, nnx.Rngs(config.seed), attention_impl=attention_impl,
                               stages=stages, microbatches=microbatches))[1]

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


def create_kv_cache(config, mesh: jax.sharding.Mesh, num_pages: int, page_size: int,
                    dtype=None, fill_value: float = 0.0, kv_cache_dtype: str = "auto",
                    stages: int = 1) -> KVCache:
    """A KVCache allocated in shards. `num_pages` is per data replica (as engine.num_pages);
    the global page axis holds data * num_pages pages. Quantized scales
    [pages, page_size, 2*H] are split exactly like the pages' first three axes. With
    `stages` > 1 each entry is [stages, ...] (models/pipeline.py), split over 'stage'."""
    heads, dp = kv_cache_heads(config, mesh), int(dict(mesh.shape).get(DATA, 1))
    staged = stages > 1
    if kv_cache_dtype == "auto":
        dtype = dtype or config.jnp_dtype
        layer = lambda: init_kv_pages(num_pages * dp, page_size, heads, config.head_dim, dtype,  # noqa: E731
                                      fill_value)
        out_shardings = kv_cache_sharding(mesh, staged=staged)
    else:
        dtype = kv_storage_dtype(kv_cache_dtype, config.jnp_dtype)
        layer = lambda: init_quantized_pages(num_pages * dp, page_size, heads, config.head_dim,  # noqa: E731
                                             dtype, fill_value)
        out_shardings = QuantizedPages(kv_cache_sharding(mesh, staged=staged),
                                       kv_cache_sharding(mesh, staged=staged, axes=KV_CACHE_AXES[:3]))
    make = jax.jit(lambda: cache_entry(layer, stages), out_shardings=out_shardings)
    return KVCache(tuple(make() for _ in range(config.num_layers // stages)), stages)
