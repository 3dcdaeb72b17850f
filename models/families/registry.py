"""The registry: `config.json`'s `architectures[0]` -> its family module.

Adding a family is one module here with a FAMILIES tuple, listed in MODULES, and its
test; nothing in engine/ or serving/ names a family.
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any, NamedTuple

from jaxfill.models.config import ConfigError, int_quantization, quantization

MODULES = ("llama", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "olmo3", "glm", "seed_oss", "exaone4",
           "ministral", "arcee", "apertus", "smollm3", "granite", "mixtral", "qwen3_moe", "glm4_moe", "gpt_oss",
           "deepseek", "qwen3_5", "qwen3_next", "qwen3_5_moe", "nemotron_h", "olmoe", "minimax_m2", "ernie4_5",
           "hunyuan", "phimoe", "lfm2", "lfm2_moe", "llama4", "granitemoehybrid",
           "kimi_linear", "deepseek_dsa", "gemma4", "bailing_hybrid", "longcat",
           "afmoe", "mistral4", "falcon_h1", "qwen3_vl")

# Architectures known and refused, with why (their config.json is never half-read)
REFUSED = {
    # transformers 5.25 runs it on CPU; what it adds over V3.2 is a new model, not a feature
    "DeepseekV4ForCausalLM": "DeepSeek V4 is not V3.2 plus a feature; missing here: manifold-constrained "
                             "hyper-connections (hc_mult residual streams mixed by Sinkhorn-normalised weights "
                             "around every block, collapsed by a hyper head), compressed attention (a sliding "
                             "window of single-KV-head MQA with K = V, beside KV compressed every 4 tokens and "
                             "chosen by a lightning indexer (CSA) or every 128 tokens (HCA), each compressor with "
                             "its own cache and rope theta), per-head attention sinks, the output rope at -position, "
                             "a grouped low-rank output projection (o_groups, o_lora_rank), hash-routed MoE layers "
                             "(tid2eid[input_ids]), sqrtsoftplus router scoring and SwiGLU clipping (swiglu_limit)",
}


# `<X>ForSequenceClassification` of a registered `<X>ForCausalLM` (engine/pooling/)
CLASSIFIER = "ForSequenceClassification"
CLASSIFIER_KEYS = ("id2label", "label2id", "num_labels", "problem_type", "pad_token_id")


@functools.lru_cache(maxsize=1)
def _by_architecture() -> dict[str, Any]:
    out = {}
    for module in MODULES:
        for family in importlib.import_module(f"jaxfill.models.families.{module}").FAMILIES:
            for arch in family.architectures:
                out[arch] = family
    return out


def architectures() -> tuple[str, ...]:
    return tuple(_by_architecture())


def families() -> list:
    """Every family once, in registry order."""
    return list(dict.fromkeys(_by_architecture().values()))


def family_of(architecture: str | None):
    table = _by_architecture()
    if architecture in REFUSED:
        raise ConfigError(f"architecture {architecture!r} is not supported: {REFUSED[architecture]}")
    if architecture not in table:
        raise ConfigError(f"architecture {architecture!r} is not supported; supported: {', '.join(table)}")
    return table[architecture]


def config_from_hf(config):
    """A Hugging Face config.json (a dict, a file, or a directory holding it; or a GGUF
    file, through the config transformers derives from it: models/gguf/) -> ModelConfig,
    through the family its `architectures[0]` names."""
    import os

    from jaxfill.models.config import read_config_json
    from jaxfill.models.gguf import gguf_file, hf_config_of

    if not isinstance(config, dict):
        gguf = gguf_file(config)
        config = hf_config_of(gguf) if gguf else read_config_json(os.fspath(config))
    archs = config.get("architectures") or []
    arch = archs[0] if archs else None
    classifier = arch and arch.endswith(CLASSIFIER) and arch.replace(CLASSIFIER, "ForCausalLM") in _by_architecture()
    if classifier:  # the decoder of its CausalLM, no LM head, score.weight on the last token
        labels = int(config.get("num_labels") or len(config.get("id2label") or {}) or 2)
        plain = {k: v for k, v in config.items() if k not in CLASSIFIER_KEYS}
        plain["architectures"] = [arch.replace(CLASSIFIER, "ForCausalLM")]
        return config_from_hf(plain).replace(num_labels=labels, has_lm_head=False)
    if arch in REFUSED:
        raise ConfigError(f"config.json architecture {arch!r} is not supported: {REFUSED[arch]}")
    if arch not in _by_architecture():
        raise ConfigError(f"config.json architecture {arch!r} is not supported; "
                          f"supported: {', '.join(architectures())}")
    if quantization.is_fp8(config):  # any family: the projections' storage, not their math
        fields = quantization.fp8_fields(config["quantization_config"])
        plain = {k: v for k, v in config.items() if k != "quantization_config"}
        return family_of(arch).to_model_config(plain, arch).replace(**fields)
    if int_quantization.is_int(config):  # AWQ / GPTQ / compressed-tensors ints, kept packed
        fields = int_quantization.int_fields(config["quantization_config"])
        plain = {k: v for k, v in config.items() if k != "quantization_config"}
        return family_of(arch).to_model_config(plain, arch).replace(**fields)
    return family_of(arch).to_model_config(config, arch)


def config_from_dict(d: dict[str, Any]):
    """A TOML [model] section -> ModelConfig: the family's switches (Family.model_defaults)
    unless the section sets them."""
    from jaxfill.models.config import ModelConfig

    d = dict(d)
    family = family_of(d.get("architecture", ModelConfig.architecture))
    for key, value in family.model_defaults(int(d.get("hidden_size", ModelConfig.hidden_size))).items():
        d.setdefault(key, value)
    return ModelConfig.from_dict(d)


def new_model(config, rngs=None, **kwargs):
    """The family's model class, built (rngs=None: seeded from config.seed)."""
    return family_of(config.architecture).model_class()(config, rngs, **kwargs)


def param_count(config) -> int:
    """Parameters of the model (int8 scales excluded), counted from its abstract params:
    the one-layer model's outside its layer, plus each layer's by its kind."""
    import dataclasses

    float_config = dataclasses.replace(config, weight_dtype="auto")
    rest = _abstract_sizes(float_config)[0]
    return rest + sum(_count(layer_params(float_config, n)) for n in range(config.num_layers))


def active_param_count(config) -> int:
    """Parameters one token goes through: a MoE layer's routed experts count k / E."""
    import dataclasses

    float_config = dataclasses.replace(config, weight_dtype="auto")
    rest = _abstract_sizes(float_config)[0]
    share = expert_share(config)
    return rest + round(sum(sum(math.prod(p.shape) * (share if is_expert_param(p) else 1)
                                for p in layer_params(float_config, n)) for n in range(config.num_layers)))


def _count(params) -> int:
    return sum(math.prod(p.shape) for p in params)


def expert_share(config) -> float:
    return config.moe.experts_per_token / config.moe.num_experts if config.moe.num_experts else 1.0


def is_expert_param(p: "ParamShape") -> bool:
    return bool(p.axes) and p.axes[0] == "experts"


def layer_kind(config, layer: int) -> str:
    """The layer's blocks: its mixer ("" attention, "linear_", "nomixer_") and its MLP
    ("dense", "moe", "nomlp")."""
    from jaxfill.models.moe import is_moe_layer

    mixer = "nomixer_" if layer in config.no_mixer_layers else "linear_" if layer in config.linear.layers else ""
    if not mixer and config.mixed_kv and config.attention.layer_window(layer) is None:
        mixer = "global_"  # Gemma 4's full layers: their own head dim and KV heads
    if config.kv_source(layer) is not None:
        mixer = "shared_" + mixer  # Gemma 4's E models: no k/v of its own (its MLP maybe twice as wide)
    mlp = "nomlp" if layer in config.no_mlp_layers else "moe" if is_moe_layer(config, layer) else "dense"
    return mixer + mlp


@functools.lru_cache(maxsize=64)
def _abstract_sizes(config) -> tuple[int, dict]:
    """(params of the one-layer model outside its layer, {layer kind: that kind's
    ParamShapes}). Layers of one kind differ only in per-layer settings
    (models/layer_settings.py), which change no shape, so one abstract layer per kind
    stands for all; eval_shape of one layer costs milliseconds where the whole 62-layer
    model costs seconds."""
    import dataclasses

    import jax
    from flax import nnx

    from jaxfill.models.sharding import var_axes

    kinds = {}
    rest = 0
    for kind in sorted({layer_kind(config, n) for n in range(config.num_layers)}):
        types = config.attention.layer_types[:1]
        if config.mixed_kv and config.attention.layer_types:
            types = ("full",) if "global_" in kind else ("sliding",)
        # a KV-sharing layer needs an earlier one to read: layer 1 of two stands for it
        shared = kind.startswith("shared_")
        one = config.replace(num_layers=2 if shared else 1, layer_types=types * (2 if shared else 1),
                             kv_shared_layers=int(shared),
                                  nope_layers=tuple(n for n in config.attention.nope_layers if n == 0),
                                  dense_layers=(0,) if kind.endswith("dense") and config.moe.num_experts else (),
                                  linear_layers=(0,) if kind.startswith("linear_") else (),
                                  no_mixer_layers=(0,) if kind.startswith("nomixer_") else (),
                                  no_mlp_layers=(0,) if kind.endswith("nomlp") else ())
        state = nnx.state(nnx.eval_shape(lambda: new_model(one, nnx.Rngs(0))))
        kinds[kind] = tuple(ParamShape(tuple(path[2:]), tuple(var.shape), tuple(var_axes(var)), var.dtype)
                            for path, var in nnx.to_flat_state(state) if path[:2] == ("layers", int(shared)))
        if not shared:
            rest = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(state)) - _count(kinds[kind])
    if config.per_layer_input_size:  # Gemma 4's per-layer tables hold P columns per layer; the model above one
        rest += (config.num_layers - 1) * config.per_layer_input_size * (
            (config.per_layer_vocab_size or config.vocab_size) + config.hidden_size)
    return rest, kinds


class ParamShape(NamedTuple):
    path: tuple  # e.g. ("attn", "q") within a layer
    shape: tuple
    axes: tuple  # logical axis names (models/sharding.py RULES)
    dtype: Any


def layer_params(config, layer: int = 0) -> tuple[ParamShape, ...]:
    """Decoder layer `layer`'s params as allocated (int8 projections and their scales
    included), from the model's abstract params: what the planner counts."""
    return _abstract_sizes(config)[1][layer_kind(config, layer)]


def layer_projection_params(config, layer: int = 0) -> dict[tuple, float]:
    """Weights per matmul of layer `layer` one token goes through (float layout): the
    projections, a MoE layer's router, and k / E of its routed experts."""
    import dataclasses

    from jaxfill.models.quant import QUANTIZED_INPUT_AXES

    float_config = dataclasses.replace(config, weight_dtype="auto")
    share = expert_share(config)
    return {p.path: math.prod(p.shape) * (share if is_expert_param(p) else 1)
            for p in layer_params(float_config, layer)
            if p.path[-1] in QUANTIZED_INPUT_AXES or p.path[-1] in LATENT_PROJECTIONS or p.path[-1] == "router"
            or (layer in config.linear.layers and p.path[-1] in LINEAR_PROJECTIONS)}


# Multi-head latent attention's projections (models/mixers/mla.py) beside q and o: each weight
# multiplies every token once (w_ukv: W_uk on the queries, W_uv on the outputs; g: Ling 2.5's
# per-head gate; index_*: the sparse-attention indexer's, models/mixers/mla_indexer.py)
LATENT_PROJECTIONS = ("q_a", "q_b", "kv_a", "w_ukv", "g", "index_q", "index_k", "index_weights")
# A linear layer's projections: Gated DeltaNet's (models/mixers/gated_deltanet.py, either layout),
# Mamba2's (models/mixers/mamba2.py), LFM2's short convolution (b, c, x, out) and KDA's
# (models/mixers/kda.py: the gates' two bottlenecks, or Ling 2.5's full-rank f and g)
LINEAR_PROJECTIONS = ("q", "k", "v", "z", "b", "a", "out", "qkvz", "ba", "x", "c", "dt", "f_a", "f_b", "g_a", "g_b",
                      "f", "g")
