"""THE jitted steps: model forward + sampler, one compiled program per bucket shape.

Module level, built once. `graph` (a StaticGraph: the graphdef, hashed once) is static;
`state` (the params, from nnx.split) is an argument, never closed over; the KV cache is donated so XLA updates it in place.
Logits exist only for one row per sequence (`meta.logits_indices`).

`step` runs one batch (one data replica). `step_replicas` runs R replicas' batches
stacked [R, ...] with the forward mapped over the mesh's 'data' axis; each replica
writes only its own slice of the page axis, and the sampled rows come back replicated
so every process of a multi-host run can read all of them.

`scores_prompt` (static) picks a second program per bucket, compiled on first use: the
last layer runs on every row and the logits also cover `batch.lp_rows`, whose log-softmax
gives prompt_logprobs requests each prompt token's logprob and top-N. Steps without
such a request keep the pruned program.

A batch with `verify` rows (speculative decoding) is another pytree, so another program
per bucket (the runner's warm-up compiles it beside the plain one): those rows' logits are sampled after the S rows, and
the output has S + Q rows (engine/speculative/verify_rows.py).

A batch with `pool_seg` (Engine.embed / score, engine/pooling/) is a third pytree: the last
layer runs on every row and the final-norm hidden states are summed per sequence as the
host's `pool_seg` assigns rows (its last row, all of them, its first), so generation-only
batches keep their program, which is compiled only when model.pooling is set. A model
without an LM head only pools: nothing is sampled.

Both take `prev_tokens`, the previous step's sampled tokens padded to R * max_num_seqs
(one shape for every bucket, so no extra compiles), and return this step's: a decode
whose input is still on the device (async scheduling) takes it from there by the row
index in `batch.prev_src` (engine/batch.py). The synchronous engine passes prev_src = -1.
"""

from __future__ import annotations

import functools

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxfill.engine.batch import StepBatch
from jaxfill.engine.sampler import MAX_LOGPROBS, SampleOutput, sample
from jaxfill.models.kv_cache import KVCache
from jaxfill.models.parallel.data import data_parallel_forward


def _replicated(x: jax.Array) -> jax.Array:
    """Pins x replicated under a mesh, so the next step gets the sharding it compiled for."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec())


def take_in_flight(batch: StepBatch,
                   prev_tokens: jax.Array,  # [P] i32
                   ) -> StepBatch:
    """Tokens (and the newest penalty-history slot) sampled by the previous step."""
    tokens = jnp.where(batch.prev_src >= 0, prev_tokens[jnp.maximum(batch.prev_src, 0)], batch.tokens)
    hist = batch.sampling.hist  # [..., S, H]
    newest = jnp.where(batch.hist_src >= 0, prev_tokens[jnp.maximum(batch.hist_src, 0)], hist[..., 0])
    sampling = dataclasses.replace(batch.sampling, hist=hist.at[..., 0].set(newest))
    return dataclasses.replace(batch, tokens=tokens, sampling=sampling)


def _pad_tokens(tokens: jax.Array,  # [n] i32
                size: int) -> jax.Array:  # [size] i32
    return _replicated(jnp.pad(tokens, (0, size - tokens.shape[0])))


def prompt_logprobs(logits: jax.Array,  # [P, V] f32
                    targets: jax.Array,  # [P] i32, -1 = padding
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:  # [P], [P, N], [P, N]
    lp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(lp, jnp.maximum(targets, 0)[:, None], axis=-1)[:, 0]
    top_lps, top_ids = jax.lax.top_k(lp, min(MAX_LOGPROBS, lp.shape[-1]))
    return chosen, top_ids.astype(jnp.int32), top_lps


def pooled_only(pooled: jax.Array) -> SampleOutput:  # [S, E] f32 -> an output with no sampled rows
    s = pooled.shape[0]
    zeros = jnp.zeros((s, MAX_LOGPROBS), jnp.float32)
    return SampleOutput(jnp.zeros(s, jnp.int32), zeros[:, 0], zeros.astype(jnp.int32), zeros, pooled=pooled)


def _step_body(forward, batch: StepBatch, prev_tokens: jax.Array,  # [P] i32
               scores_prompt: bool = False) -> tuple[SampleOutput, KVCache, jax.Array]:
    """What every step does: the previous step's tokens in, forward, sample, tokens out.
    `forward(tokens [N], positions [N], meta) -> (logits [rows, V], cache)` with the
    batch's leaves flattened to one row axis (a no-op for one replica)."""
    batch = take_in_flight(batch, prev_tokens)
    n = batch.tokens.size
    meta = batch.meta
    s = meta.logits_indices.shape[-1]
    verify = batch.verify  # rows verifying proposals (one replica only: speculative refuses mesh.data)
    if scores_prompt:  # more rows than one per sequence: the last layer is not pruned
        meta = dataclasses.replace(meta, logits_indices=jnp.concatenate(
            [meta.logits_indices, jnp.maximum(batch.lp_rows, 0)], axis=-1))
    if verify is not None:  # they come last, after the sampled and scored rows
        meta = dataclasses.replace(meta, logits_indices=jnp.concatenate([meta.logits_indices, verify.rows]))
    pooled = None
    extra = {} if batch.vision is None else {"vision": batch.vision}  # one replica only (capability table)
    with jax.named_scope("model"):
        if batch.pool_seg is None:
            logits, kv_cache = forward(batch.tokens.reshape(n), batch.positions.reshape(n), meta, **extra)
        else:  # the pooling variant: every row's final-norm hidden state, summed per sequence
            logits, kv_cache, pooled = forward(batch.tokens.reshape(n), batch.positions.reshape(n), meta,
                                               pool_seg=batch.pool_seg.reshape(n), **extra)
    if logits is None:  # a model without an LM head: it only pools, nothing is sampled
        return pooled_only(pooled), kv_cache, prev_tokens
    if verify is not None:  # [S (+ P) + Q, V] -> the rest, and the Q verification rows
        q = verify.rows.shape[0]
        logits, verify_logits = logits[:-q], logits[-q:]
    prompt = None
    if scores_prompt:  # [R * (S + P), V] replica-major -> sampled rows, scored rows
        v = logits.shape[-1]
        per = logits.reshape(-1, s + batch.lp_rows.shape[-1], v)
        logits = per[:, :s].reshape(-1, v)
        prompt = prompt_logprobs(per[:, s:].reshape(-1, v), batch.lp_targets.reshape(-1))
    with jax.named_scope("sampler"):
        sampling = batch.sampling
        if batch.tokens.ndim == 2:  # [R, ...] replicas: one row axis, replica-major
            sampling = jax.tree.map(lambda x: x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:]), sampling)
        if verify is not None:  # one sampler call: rows [S + Q], each row's draw its own (sampler.py)
            logits = jnp.concatenate([logits, verify_logits])
            sampling = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), sampling, verify.sampling)
        out = dataclasses.replace(sample(logits, sampling), prompt=prompt, pooled=pooled)
    sampled = out.tokens if verify is None else out.tokens[:s]
    return out, kv_cache, _pad_tokens(sampled, prev_tokens.shape[0])


class StaticGraph:
    """The model's structure as the steps' static argument, its hash computed once. jit
    hashes a static argument on every call, and nnx's GraphDef.__hash__ walks the whole
    module tree: for SmolLM2-135M (30 layers) most of a decode step's 8 ms of dispatch on
    the host (cProfile). The runner holds one (Runner.static_graph) beside its graphdef."""

    __slots__ = ("graphdef", "_hash")

    def __init__(self, graphdef: nnx.GraphDef):
        self.graphdef = graphdef
        self._hash = hash(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, StaticGraph) and self._hash == other._hash
                                 and self.graphdef == other.graphdef)


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=2)
def step(graph: StaticGraph,
         state: nnx.State,
         kv_cache: KVCache,
         batch: StepBatch,  # leaves [T] / [S, ...]
         prev_tokens: jax.Array,  # [P] i32, the previous step's tokens, padded
         scores_prompt: bool = False,
         ) -> tuple[SampleOutput, KVCache, jax.Array]:  # [S] rows, cache, [P] tokens
    model = nnx.merge(graph.graphdef, state)
    return _step_body(lambda tokens, positions, meta, **kw: model(tokens, positions, kv_cache, meta, **kw), batch,
                      prev_tokens, scores_prompt)


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=2)
def step_replicas(graph: StaticGraph,
                  state: nnx.State,
                  kv_cache: KVCache,  # pages [R * num_pages, ...], split over 'data'
                  batch: StepBatch,  # every leaf stacked [R, ...], split over 'data'
                  prev_tokens: jax.Array,  # [P] i32, the previous step's tokens, padded, replicated
                  scores_prompt: bool = False,
                  ) -> tuple[SampleOutput, KVCache, jax.Array]:  # [R * S] rows, replica-major
    def forward(tokens, positions, meta):
        return data_parallel_forward(graph.graphdef, state, tokens, positions, kv_cache, meta)

    out, kv_cache, tokens = _step_body(forward, batch, prev_tokens, scores_prompt)
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, PartitionSpec()), out), kv_cache, tokens
