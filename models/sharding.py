"""Logical axis names -> mesh axes: the one rules table, and what places by it. The
executors that run a layer over a mesh axis (shard_map) live in models/parallel/: data.py,
expert.py, heads.py, vocab.py, context.py (with ring_attention.py) and pipeline.py; they
name mesh axes through the constants here (DATA, TENSOR, ...).

Model code labels arrays with logical names ('vocab', 'embed', 'q_heads', ...; see
RULES) and calls `constrain` here, and models/parallel/'s `vocab_parallel_embed`,
`split_over_heads`, `expert_parallel` and `sharded_attention`; with no mesh
in context those are no-ops, so the single-device model is exactly the unsharded one.
Put a mesh in context with `jax.set_mesh(mesh)` around the jitted call (the mesh's axes
are AxisType.Auto, see engine/mesh.py) and the same model code runs:

* tensor parallel (Megatron) over 'tensor': q/k/v and gate/up split by heads/columns,
  o and down by rows (one all-reduce after attention, one after the MLP), vocab-parallel
  embedding (masked local lookup + all-reduce) and LM head (logits stay vocab-sharded);
  the KV cache split by KV head on axis 2 of the pages. K/V are interleaved there
  (2h = K_h, 2h+1 = V_h), so contiguous shards keep each (K_h, V_h) pair together.
  With fewer KV heads than 'tensor' (GQA, Hkv=2 on tensor=8), the k/v weights stay
  replicated, every rank computes the Hkv heads (a small matmul) and repeats each head
  r = tensor / Hkv times; the cache then holds Hkv * r heads, one (or Hkv*r/tensor) per
  rank, instead of a replicated Hkv-head cache on every rank. Query head j still reads
  original KV head j // (Hq/Hkv): repeating head h into r consecutive heads keeps GQA's
  contiguous grouping. `kv_cache_heads(config, mesh)` says how many heads to allocate.
* context parallel over 'sequence': the flat token axis is split, so every matmul is
  local, and so is the page pool: each rank holds num_pages / N of it, and logical page
  j of every sequence lives on rank j mod N (the block manager deals pages by that rule;
  page ids are global, rank r owning ids [r * P/N, (r + 1) * P/N)). Attention is pass-Q
  (`context_attention`): every rank all-gathers the layer's Q and new K/V, writes the
  rows whose pages it owns, attends all query rows against its own pages (a round-robin
  1/N of every sequence's keys, so the causal work is balanced to a page), and the
  partial outputs merge by log-sum-exp: one all-max of the LSEs and one reduce-scatter
  that hands each rank its own rows back. Decode is the same code (a decode row's keys
  are spread over the ranks too). KV memory per device is O(S / N). The attention side
  lives in models/parallel/context.py.
* pipeline parallel over 'stage' (models/parallel/pipeline.py): layer params stacked [stage, ...]
  and cache entries [stage, pages, ...] split over 'stage', so a stage holds only its
  layers; the embedding and LM head split their vocab over 'stage' as well as 'tensor'.
* expert parallel over 'expert' (models/parallel/expert.py): a MoE layer's experts split over
  it, their columns over 'tensor'; what 'tensor' splits elsewhere splits over tensor x
  expert (HEADS). Tokens arrive replicated over both, so each rank runs the pairs routed
  to its own experts and one all-reduce sums the partial outputs (no all-to-all).
* data parallel over 'data': models/parallel/data.py maps the whole forward over 'data'
  with shard_map; each replica gets its own tokens, metadata and page pool (pages axis 0
  is split over 'data'; page ids in a replica's metadata are local to its pool).

Rules, placements and in-model constraints only: building params and caches in their
shards lives in engine/placement.py, the jitted data-parallel forward in models/forward.py,
and HLO collective counting in benchmarks/hlo_collectives.py. Nothing here imports the model.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

STAGE, DATA, TENSOR, EXPERT, SEQUENCE = "stage", "data", "tensor", "expert", "sequence"
MESH_AXES = (STAGE, DATA, TENSOR, EXPERT, SEQUENCE)
# Attention heads and dense MLP columns split over tensor x expert: the ranks of an expert
# group hold different experts but share the rest of the layer as tensor-parallel ranks.
HEADS = (TENSOR, EXPERT)

# logical name -> mesh axis (or tuple of axes, or None = replicated)
RULES: dict[str, Any] = {
    # params
    "stage": STAGE,  # the leading axis of a pipelined model's stacked layer params
    "vocab": HEADS + (STAGE,),  # embedding and LM head: split over stages too
    "embed": None,
    "q_heads": HEADS,
    "kv_heads": HEADS,  # dropped (replicated) when Hkv is not a multiple of tensor x expert
    "head_dim": None,
    "mlp": HEADS,
    "norm": None,
    "vision": None,  # every weight of a vision tower (models/vision/): small beside the decoder, replicated
    "labels": None,  # a sequence-classification head's outputs (models/decoder.py score)
    "experts": EXPERT,  # a MoE layer's stacked experts (models/moe.py)
    "moe_mlp": TENSOR,  # an expert's intermediate columns
    # activations
    "tokens": SEQUENCE,
    "act_embed": None,
    "act_heads": HEADS,
    "act_kv_heads": HEADS,
    "act_mlp": HEADS,
    "act_vocab": HEADS + (STAGE,),  # logits split like the LM head: never gather the head
    "seqs": None,
    # one layer's KV pages [num_pages, page_size, 2*Hkv, D] ([stage, ...] when pipelined)
    "cache_stage": STAGE,
    "cache_pages": (DATA, SEQUENCE),  # one pool per replica, dealt over its sequence ranks
    "replicas": DATA,  # per data replica counters (a MoE layer's expert token counts)
    "cache_slots": None,
    "cache_heads": HEADS,
    "cache_head_dim": None,
}
KV_CACHE_AXES = ("cache_pages", "cache_slots", "cache_heads", "cache_head_dim")


def mesh_axis_size(mesh, axis) -> int:
    if mesh is None or axis is None:
        return 1
    names = axis if isinstance(axis, tuple) else (axis,)
    shape = dict(zip(mesh.axis_names, mesh.axis_sizes)) if hasattr(mesh, "axis_sizes") else dict(mesh.shape)
    return int(np.prod([shape.get(n, 1) for n in names]))


def logical_spec(axes: Sequence[str | None], rules: Mapping[str, Any] | None = None,
                 mesh=None, shape: Sequence[int] | None = None,
                 exclude: frozenset = frozenset()) -> P:
    """Logical names -> PartitionSpec. With mesh and shape, a dim not divisible by its mesh
    axes is replicated instead (e.g. 2 KV heads on tensor=4); mesh axes absent from the
    mesh, in `exclude` (manual in the current context), or already used are dropped, and
    so is an 'expert' axis of size 1 (a mesh without experts keeps the specs it had)."""
    rules = RULES if rules is None else rules
    used: set[str] = set()
    out = []
    for i, name in enumerate(axes):
        axis = rules.get(name) if name is not None else None
        if axis is not None:
            names = tuple(a for a in (axis if isinstance(axis, tuple) else (axis,))
                          if a not in used and a not in exclude
                          and (mesh is None or a in mesh.axis_names)
                          and not (a == EXPERT and mesh is not None and mesh_axis_size(mesh, a) == 1))
            axis = (names[0] if len(names) == 1 else names) if names else None
        if axis is not None and mesh is not None and shape is not None and shape[i] % mesh_axis_size(mesh, axis):
            axis = None
        if axis is not None:
            used.update(axis if isinstance(axis, tuple) else (axis,))
        out.append(axis)
    return P(*out)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def var_axes(var: nnx.Variable) -> tuple:
    meta = var.get_metadata()
    axes = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
    if axes is None:
        return (None,) * len(var.shape)
    return tuple(axes)


def var_sharding(var: nnx.Variable, mesh: jax.sharding.Mesh,
                 rules: Mapping[str, Any] | None = None) -> NamedSharding:
    """The NamedSharding of one param (abstract or concrete) from its logical axis names."""
    return NamedSharding(mesh, logical_spec(var_axes(var), rules, mesh, var.shape))


def param_shardings(state: nnx.State, mesh: jax.sharding.Mesh,
                    rules: Mapping[str, Any] | None = None) -> nnx.State:
    """A pytree matching `state` (abstract or concrete) with a NamedSharding per param."""
    return jax.tree.map(lambda var: var.replace(var_sharding(var, mesh, rules)), state, is_leaf=_is_var)


def shard_params(state: nnx.State, mesh: jax.sharding.Mesh,
                 rules: Mapping[str, Any] | None = None) -> nnx.State:
    """Moves an already materialised state onto the mesh (tests, small models)."""
    return jax.device_put(state, param_shardings(state, mesh, rules))


# ----------------------------------------------------------------------------- KV cache
def head_repeat(num_kv_heads: int, tensor: int) -> int:
    """How many times each KV head is repeated so the cache splits evenly over `tensor`
    ranks (the planner uses the same rule without a mesh)."""
    if num_kv_heads % tensor == 0:
        return 1
    if tensor % num_kv_heads == 0:
        return tensor // num_kv_heads
    raise ValueError(f"mesh.tensor={tensor} and model.num_kv_heads={num_kv_heads} must divide one another")


def kv_repeat(num_kv_heads: int, mesh) -> int:
    """head_repeat for the mesh's head split, tensor x expert (1 without them)."""
    return head_repeat(num_kv_heads, mesh_axis_size(mesh, HEADS))


def kv_cache_heads(config, mesh, num_kv_heads: int | None = None) -> int:
    """KV heads per layer the cache holds under `mesh` (Hkv, or Hkv repeated up to tensor);
    `num_kv_heads`: a layer's own count (Gemma 4's full layers), else the model's."""
    heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
    return heads * kv_repeat(heads, mesh)


def kv_cache_sharding(mesh: jax.sharding.Mesh, rules: Mapping[str, Any] | None = None,
                      staged: bool = False, axes: Sequence[str] = KV_CACHE_AXES) -> NamedSharding:
    """One layer's pages [num_pages, page_size, 2*H, D]: pages split over 'data' (one pool
    per replica) and within it over 'sequence' (context parallelism), heads over 'tensor'
    (K/V pairs stay together).
    A pipelined model's entry has a leading [stage] axis, split over 'stage'. `axes`: the
    leading ones only, for a quantized layer's scales [num_pages, page_size, 2*H]."""
    return NamedSharding(mesh, logical_spec((("cache_stage",) if staged else ()) + tuple(axes), rules, mesh))


def linear_state_sharding(mesh: jax.sharding.Mesh, staged: bool = False) -> NamedSharding:
    """A linear layer's state, recurrent [slots, Hv, Dk, Dv] and conv [slots, channels, K-1]
    (channels group by group: Gated DeltaNet's key-head groups, Mamba2's groups): slots
    split over 'data' (one pool per replica, as the pages: the data-parallel forward maps
    the cache's leading axis), heads over 'tensor', where split_over_heads runs the
    mixer; replicated over 'expert', whose ranks share the layer as they share its tokens.
    `staged`: a stacked layout's entry [groups, slots, ...], the group axis split over
    'stage' like the pages' (whole on every device under engine.scan_layers, stage = 1)."""
    lead = ((STAGE if STAGE in mesh.axis_names else None),) if staged else ()
    return NamedSharding(mesh, P(*lead, DATA if DATA in mesh.axis_names else None, TENSOR))


# ------------------------------------------------------------------ model-side helpers
def context_mesh():
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else mesh


def manual_axes(mesh) -> frozenset:
    """Mesh axes that are manual in the current context (inside a shard_map over them)."""
    return frozenset(getattr(mesh, "manual_axes", ()) or ())


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """with_sharding_constraint by logical names; a no-op without a mesh in context."""
    mesh = context_mesh()
    if mesh is None:
        return x
    spec = logical_spec(axes, RULES, mesh, x.shape, exclude=manual_axes(mesh))
    if all(s is None for s in spec) and not manual_axes(mesh) and mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, spec)


def rows_split_over_sequence() -> bool:
    """True when the context mesh splits the flat token rows over 'sequence'."""
    mesh = context_mesh()
    return mesh is not None and bool(free_axes(mesh, SEQUENCE))


def kv_heads_for(pages_heads: int, num_kv_heads: int) -> int:
    """Repeat factor the cache layout implies (pages hold 2 * Hkv * r heads)."""
    r, rem = divmod(pages_heads // 2, num_kv_heads)
    if rem or r < 1:
        raise ValueError(f"pages hold {pages_heads // 2} KV heads, model has {num_kv_heads}")
    return r


def free_axes(mesh, *names):
    """Mesh axes among `names` that are not manual here and have size > 1."""
    manual = manual_axes(mesh)
    return tuple(n for n in names if n in mesh.axis_names and n not in manual and mesh_axis_size(mesh, n) > 1)
