"""THE jitted step: model forward + sampler, one compiled program per bucket shape.

Module level, built once. `graphdef` is static; `state` (the params, from nnx.split) is
an argument, never closed over; the KV cache is donated so XLA updates it in place.
Logits exist only for one row per sequence (`meta.logits_indices`).
"""

from __future__ import annotations

import functools

import jax
from flax import nnx

from engine.batch import StepBatch
from engine.sampler import SampleOutput, sample
from models.kv_cache import KVCache


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def step(graphdef: nnx.GraphDef,
         state: nnx.State,
         kv_cache: KVCache,
         batch: StepBatch,
         ) -> tuple[SampleOutput, KVCache]:
    model = nnx.merge(graphdef, state)
    with jax.named_scope("model"):
        logits, kv_cache = model(batch.tokens, batch.positions, kv_cache, batch.meta)  # [S, V]
    with jax.named_scope("sampler"):
        out = sample(logits, batch.sampling)
    return out, kv_cache
