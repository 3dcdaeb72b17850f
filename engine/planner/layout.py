"""What one device holds under a mesh, as models/sharding.py and models/parallel/pipeline.py lay it out.

The planner's memory side (engine/planner/plan.py does the time side). Arithmetic only; the
rules mirrored here (tests/test_planner.py checks them against the logical axes of
`Decoder(config, plan=ExecutionPlan.stacked(p))` under an abstract mesh):

* a decoder layer's params split as their logical axes say (`param_bytes_per_device`):
  q, o, gate, up, down (and q bias, and the int8 scales of q, gate, up) over tensor x
  expert; k and v (bias, scales) too when Hkv divides by it, else every rank holds them
  whole; a MoE layer's experts over 'expert' and their columns over 'tensor'; norms, the
  router and the int8 scales of o and down (one per `embed` channel) replicated.
* with p = mesh.stage, every layer param is stacked [p, ...] and split over 'stage': a
  device holds L / p layers.
* embedding and LM head split their vocab over tensor x expert x stage when it divides the vocab,
  else every device holds them whole; the final norm is replicated.
* a KV cache entry is [p, pages, page_size, 2H, D]: a device stores L / p layers of the
  Hkv * r heads (r = repeats up to tensor x expert) split over tensor x expert.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from jaxfill.engine.config import MeshSettings
from jaxfill.models.config import ModelConfig
from jaxfill.models.families.registry import ParamShape, layer_params
from jaxfill.models.kv_cache import kv_bytes_per_token as cache_bytes_per_token, shares_kv
from jaxfill.models.parallel.pipeline import microbatch_count
from jaxfill.models.sharding import MESH_AXES, RULES, head_repeat, logical_spec, mesh_axis_size

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(model: ModelConfig) -> int:
    return DTYPE_BYTES[model.dtype]


def kv_repeat(model: ModelConfig, heads_split: int) -> int:
    """Copies of each KV head so the cache splits evenly over tensor x expert (models/sharding.py's rule)."""
    return head_repeat(model.num_kv_heads, heads_split)


def vocab_split(model: ModelConfig, mesh: MeshSettings) -> int:
    """Devices the embedding and LM head are split over: tensor x expert x stage when that
    divides the vocab, else 1 (the sharding rules then replicate the whole table)."""
    n = mesh.heads * mesh.stage
    return n if model.vocab_size % n == 0 else 1


class _MeshSizes(NamedTuple):  # what models/sharding.py's logical_spec reads of a mesh
    axis_names: tuple
    axis_sizes: tuple


def param_bytes_per_device(p: ParamShape, mesh: MeshSettings) -> float:
    """One layer param's bytes on one device: its logical axes resolved by the sharding
    rules (models/sharding.py), a dim that does not divide kept whole, as placement does."""
    sizes = _MeshSizes(MESH_AXES, tuple(getattr(mesh, a) for a in MESH_AXES))
    spec = logical_spec(p.axes, RULES, sizes, p.shape)
    used = tuple(a for entry in spec if entry for a in (entry if isinstance(entry, tuple) else (entry,)))
    return math.prod(p.shape) * np.dtype(p.dtype).itemsize / mesh_axis_size(sizes, used or None)


def vocab_param_bytes(model: ModelConfig) -> int:
    """Embedding table plus the LM head when untied (global bytes)."""
    tables = 1 if model.embeddings.tied else 2
    return tables * model.vocab_size * model.hidden_size * dtype_bytes(model)


def layer_bytes_per_device(model: ModelConfig, mesh: MeshSettings, layers: int | None = None) -> float:
    """Bytes of `layers` decoder layers (default: the L / stage of a stage) on one device;
    the stage holding the most when the layers differ (a MoE model's dense layers)."""
    n = model.num_layers // mesh.stage if layers is None else layers
    per_layer = [sum(param_bytes_per_device(p, mesh) for p in layer_params(model, i)) for i in range(model.num_layers)]
    return max(sum(per_layer[s:s + n]) for s in range(0, model.num_layers - n + 1, n))


def weight_bytes_per_device(model: ModelConfig, mesh: MeshSettings) -> float:
    """Every param byte one device holds: its stage's layers, its share of the vocab
    tables, the final norm. The one formula for the planner's memory figures."""
    return (layer_bytes_per_device(model, mesh) + vocab_param_bytes(model) / vocab_split(model, mesh)
            + model.hidden_size * dtype_bytes(model))


def kv_heads_per_device(model: ModelConfig, heads_split: int) -> int:
    """KV heads one device stores when the heads split over `heads_split` (tensor x expert) ranks."""
    return model.num_kv_heads * kv_repeat(model, heads_split) // heads_split


def kv_bytes_per_token_per_device(model: ModelConfig, mesh: MeshSettings, kv_cache_dtype: str = "auto") -> int:
    """Cache bytes one token costs on one device: its stage's L / p layers, its heads."""
    if not model.mixed_kv:
        return cache_bytes_per_token(model.kv_layers // mesh.stage, kv_heads_per_device(model, mesh.heads),
                                     model.head_dim, kv_cache_dtype, model.jnp_dtype, shares_kv(model))
    split = mesh.heads  # Gemma 4: each shape's layers with their own heads (never staged: capability table)
    return sum(cache_bytes_per_token(layers, heads * head_repeat(heads, split) // split, dim, kv_cache_dtype,
                                     model.jnp_dtype, shares_kv(model))
               for (heads, dim), layers in model.kv_shapes().items())


def pipeline_microbatches(mesh: MeshSettings, num_tokens: int) -> int:
    """Microbatches a step of `num_tokens` is cut into (1 without pipeline stages):
    mesh.microbatches cut down to a divisor of the tokens, as models/parallel/pipeline.py does."""
    return microbatch_count(num_tokens, mesh.microbatches) if mesh.stage > 1 else 1


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle share of each stage in a GPipe fill-drain step: p - 1 of its m + p - 1 ticks."""
    return (stages - 1) / (microbatches + stages - 1)
