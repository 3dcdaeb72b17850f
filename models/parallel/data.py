"""Data parallelism over 'data': the whole forward mapped over the replicas, each with its
own tokens, metadata and page pool (engine/step.py `step_replicas`, models/forward.py).
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxfill.models.sharding import DATA, context_mesh, free_axes


def data_parallel_forward(graphdef: nnx.GraphDef, state: nnx.State,
                          tokens: jax.Array,  # [DP * T] int32, replica r owns rows [r*T, (r+1)*T)
                          positions: jax.Array,  # [DP * T] int32
                          kv_cache,  # KVCache, pages [DP * num_pages, page_size, 2H, D]
                          meta,  # AttentionMetadata, every leaf stacked per replica: [DP, ...]
                          ):  # logits [DP * S, V], kv_cache
    """The forward mapped over 'data' (call inside jit with the mesh in context).

    Each 'data' replica runs the ordinary model on its own batch: its T tokens, its own
    metadata (page ids local to its pool: 0..num_pages-1) and its own slice of the page
    axis. Params are replicated over 'data' (and still split over 'tensor'); tensor and
    sequence parallelism work inside each replica unchanged. No collective crosses
    'data'. Without 'data' in the context mesh it is the plain forward of replica 0.
    """
    mesh = context_mesh()
    if mesh is None or DATA not in free_axes(mesh, DATA):
        if tokens.shape[0] != meta.slot_mapping.shape[-1]:
            raise ValueError("no 'data' axis > 1 in the context mesh: pass one replica's batch")
        return nnx.merge(graphdef, state)(tokens, positions, kv_cache, jax.tree.map(lambda x: x[0], meta))

    def local(state, tokens, positions, kv_cache, meta):
        meta = jax.tree.map(lambda x: x[0], meta)
        return nnx.merge(graphdef, state)(tokens, positions, kv_cache, meta)

    cache = P(None, DATA) if kv_cache.stages > 1 else P(DATA)  # the page axis
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(DATA), P(DATA), cache, P(DATA)),
                         out_specs=(P(DATA), cache), axis_names={DATA},
                         check_vma=False)(state, tokens, positions, kv_cache, meta)
