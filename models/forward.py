"""The jitted functional forwards: state in, cache in, logits and cache out (cache donated).

`graphdef` is static (it holds the module structure and the attention impl); `state`
holds the params and is an ordinary argument, never closed over, so one compiled
function serves any weights of the same shape.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx

from jaxfill.models.kv_cache import AttentionMetadata, KVCache
from jaxfill.models.parallel.data import data_parallel_forward


@functools.partial(jax.jit, static_argnums=0, donate_argnums=4)
def forward(graphdef: nnx.GraphDef,
            state: nnx.State,
            tokens: jax.Array,  # [T] int32
            positions: jax.Array,  # [T] int32
            kv_cache: KVCache,
            meta: AttentionMetadata,
            ) -> tuple[jax.Array, KVCache]:  # logits [S, vocab] float32
    model = nnx.merge(graphdef, state)
    return model(tokens, positions, kv_cache, meta)


# The forward mapped over 'data' (replicas stacked; call with the mesh in context). The
# engine jits its own version with the sampler in engine/step.py; this one serves tests
# and benchmarks.
forward_data_parallel = jax.jit(data_parallel_forward, static_argnums=0, donate_argnums=4)
