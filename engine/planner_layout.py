"""What one device holds under a mesh, as models/sharding.py and models/pipeline.py lay it out.

The planner's memory side (engine/planner.py does the time side). Arithmetic only; the
rules mirrored here (tests/test_planner.py checks them against the logical axes of
`Decoder(config, stages=p)` under an abstract mesh):

* a decoder layer's q, o, gate, up, down (and q bias, and the int8 scales of q, gate, up)
  split over 'tensor'; k and v (bias, scales) split too when Hkv divides by 'tensor', else
  every tensor rank holds them whole; the two norms and the int8 scales of o and down
  (one per `embed` channel) are replicated over 'tensor'.
* with p = mesh.stage, every layer param is stacked [p, ...] and split over 'stage': a
  device holds L / p layers.
* embedding and LM head split their vocab over tensor x stage when it divides the vocab,
  else every device holds them whole; the final norm is replicated.
* a KV cache entry is [p, pages, page_size, 2H, D]: a device stores L / p layers of the
  Hkv * r heads (r = repeats up to 'tensor') split over 'tensor'.
"""

from __future__ import annotations

import math

import numpy as np

from jaxfill.engine.config import MeshSettings
from jaxfill.models.config import ModelConfig
from jaxfill.models.families.registry import layer_params
from jaxfill.models.kv_cache import kv_bytes_per_token as cache_bytes_per_token
from jaxfill.models.pipeline import microbatch_count
from jaxfill.models.sharding import RULES, TENSOR, head_repeat

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(model: ModelConfig) -> int:
    return DTYPE_BYTES[model.dtype]


def kv_repeat(model: ModelConfig, tensor: int) -> int:
    """Copies of each KV head so the cache splits evenly over 'tensor' (models/sharding.py's rule)."""
    return head_repeat(model.num_kv_heads, tensor)


def check_mesh(model: ModelConfig, mesh: MeshSettings) -> None:
    tp = mesh.tensor
    if model.num_heads % tp:
        raise ValueError(f"mesh.tensor={tp} does not divide model.num_heads={model.num_heads}")
    kv_repeat(model, tp)
    if model.intermediate_size % tp:
        raise ValueError(f"mesh.tensor={tp} does not divide model.intermediate_size={model.intermediate_size}")
    if model.num_layers % mesh.stage:
        raise ValueError(f"mesh.stage={mesh.stage} does not divide model.num_layers={model.num_layers}: "
                         "every pipeline stage holds the same number of layers")


def vocab_split(model: ModelConfig, mesh: MeshSettings) -> int:
    """Devices the embedding and LM head are split over: tensor x stage when that divides
    the vocab, else 1 (the sharding rules then replicate the whole table)."""
    n = mesh.tensor * mesh.stage
    return n if model.vocab_size % n == 0 else 1


def layer_param_bytes(model: ModelConfig, tensor: int) -> tuple[int, int]:
    """(bytes split over 'tensor', bytes every tensor rank holds whole) of one decoder
    layer, as allocated (int8: one byte per projection weight plus f32 scales), read off
    the model's abstract params and their logical axes (models/sharding.py RULES; KV heads
    stay whole when they do not divide by 'tensor')."""
    split = whole = 0
    for p in layer_params(model):
        nbytes = math.prod(p.shape) * np.dtype(p.dtype).itemsize
        if any(RULES.get(a) == TENSOR and (a != "kv_heads" or model.num_kv_heads % tensor == 0) for a in p.axes):
            split += nbytes
        else:
            whole += nbytes
    return split, whole


def vocab_param_bytes(model: ModelConfig) -> int:
    """Embedding table plus the LM head when untied (global bytes)."""
    tables = 1 if model.tie_word_embeddings else 2
    return tables * model.vocab_size * model.hidden_size * dtype_bytes(model)


def layer_bytes_per_device(model: ModelConfig, mesh: MeshSettings, layers: int | None = None) -> float:
    """Bytes of `layers` decoder layers (default: this device's L / stage) on one device."""
    split, whole = layer_param_bytes(model, mesh.tensor)
    n = model.num_layers // mesh.stage if layers is None else layers
    return n * (split / mesh.tensor + whole)


def weight_bytes_per_device(model: ModelConfig, mesh: MeshSettings) -> float:
    """Every param byte one device holds: its stage's layers, its share of the vocab
    tables, the final norm. The one formula for the planner's memory figures."""
    return (layer_bytes_per_device(model, mesh) + vocab_param_bytes(model) / vocab_split(model, mesh)
            + model.hidden_size * dtype_bytes(model))


def kv_heads_per_device(model: ModelConfig, tensor: int) -> int:
    return model.num_kv_heads * kv_repeat(model, tensor) // tensor


def kv_bytes_per_token_per_device(model: ModelConfig, mesh: MeshSettings, kv_cache_dtype: str = "auto") -> int:
    """Cache bytes one token costs on one device: its stage's L / p layers, its heads."""
    return cache_bytes_per_token(model.num_layers // mesh.stage, kv_heads_per_device(model, mesh.tensor),
                                 model.head_dim, kv_cache_dtype, model.jnp_dtype)


def pipeline_microbatches(mesh: MeshSettings, num_tokens: int) -> int:
    """Microbatches a step of `num_tokens` is cut into (1 without pipeline stages):
    mesh.microbatches cut down to a divisor of the tokens, as models/pipeline.py does."""
    return microbatch_count(num_tokens, mesh.microbatches) if mesh.stage > 1 else 1


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle share of each stage in a GPipe fill-drain step: p - 1 of its m + p - 1 ticks."""
    return (stages - 1) / (microbatches + stages - 1)
