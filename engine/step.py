"""THE jitted steps: model forward + sampler, one compiled program per bucket shape.

Module level, built once. `graphdef` is static; `state` (the params, from nnx.split) is
an argument, never closed over; the KV cache is donated so XLA updates it in place.
Logits exist only for one row per sequence (`meta.logits_indices`).

`step` runs one batch (one data replica). `step_replicas` runs R replicas' batches
stacked [R, ...] with the forward mapped over the mesh's 'data' axis; each replica
writes only its own slice of the page axis, and the sampled rows come back replicated
so every process of a multi-host run can read all of them.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx
from jax.sharding import PartitionSpec

from jaxfill.engine.batch import StepBatch
from jaxfill.engine.sampler import SampleOutput, sample
from jaxfill.models.kv_cache import KVCache
from jaxfill.models.sharding import data_parallel_forward


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def step(graphdef: nnx.GraphDef,
         state: nnx.State,
         kv_cache: KVCache,
         batch: StepBatch,  # leaves [T] / [S, ...]
         ) -> tuple[SampleOutput, KVCache]:  # [S] rows
    model = nnx.merge(graphdef, state)
    with jax.named_scope("model"):
        logits, kv_cache = model(batch.tokens, batch.positions, kv_cache, batch.meta)  # [S, V]
    with jax.named_scope("sampler"):
        out = sample(logits, batch.sampling)
    return out, kv_cache


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def step_replicas(graphdef: nnx.GraphDef,
                  state: nnx.State,
                  kv_cache: KVCache,  # pages [R * num_pages, ...], split over 'data'
                  batch: StepBatch,  # every leaf stacked [R, ...], split over 'data'
                  ) -> tuple[SampleOutput, KVCache]:  # [R * S] rows, replica-major
    r, t = batch.tokens.shape
    with jax.named_scope("model"):
        logits, kv_cache = data_parallel_forward(graphdef, state, batch.tokens.reshape(r * t),
                                                 batch.positions.reshape(r * t), kv_cache, batch.meta)
    with jax.named_scope("sampler"):
        sampling = jax.tree.map(lambda x: x.reshape((r * x.shape[1],) + x.shape[2:]), batch.sampling)
        out = sample(logits, sampling)
    out = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, PartitionSpec()), out)
    return out, kv_cache
