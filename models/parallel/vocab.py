"""Vocab parallelism: the embedding lookup in a table split by vocab rows over 'tensor'
(and 'stage'); the LM head stays a sharded matmul (models/layers.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxfill.models.sharding import (RULES, SEQUENCE, constrain, context_mesh, free_axes, logical_spec,
                                     manual_axes, mesh_axis_size)


def vocab_parallel_embed(table: jax.Array,  # [V, E] logical ('vocab', 'embed')
                         tokens: jax.Array,  # [T] int32
                         ) -> jax.Array:  # [T, E]
    """Row lookup in a vocab-sharded table: each rank looks up the ids in its vocab slice
    (others give 0) and one all-reduce sums them. The vocab splits over 'tensor' and, for a
    pipelined model, 'stage' too. Without a mesh: jnp.take."""
    mesh = context_mesh()
    spec = () if mesh is None else logical_spec(("vocab", "embed"), RULES, mesh, table.shape,
                                                exclude=manual_axes(mesh))[0]
    vocab = tuple(a for a in ((spec,) if isinstance(spec, str) else spec or ()) if mesh_axis_size(mesh, a) > 1)
    if not vocab:
        return constrain(jnp.take(table, tokens, axis=0), ("tokens", "act_embed"))
    tok_axis = SEQUENCE if (free_axes(mesh, SEQUENCE)
                            and tokens.shape[0] % mesh_axis_size(mesh, SEQUENCE) == 0) else None

    def local(tab, tok):  # tab [V / vocab shards, E], tok [T/sp]
        vl = tab.shape[0]
        ids = tok - jax.lax.axis_index(vocab) * vl
        ok = (ids >= 0) & (ids < vl)
        rows = jnp.take(tab, jnp.where(ok, ids, 0), axis=0)
        return jax.lax.psum(jnp.where(ok[:, None], rows, jnp.zeros_like(rows)), vocab)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(vocab, None), P(tok_axis)), out_specs=P(tok_axis, None),
                         axis_names=set(vocab) | ({tok_axis} if tok_axis else set()),
                         check_vma=False)(table, tokens)
