"""The registry: `config.json`'s `architectures[0]` -> its family module.

Adding a family is one module here with a FAMILIES tuple, listed in MODULES, and its
test; nothing in engine/ or serving/ names a family.
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any, NamedTuple

from jaxfill.models.config import ConfigError

MODULES = ("llama", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "smollm3", "granite", "mixtral", "qwen3_moe")


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
    if architecture not in table:
        raise ConfigError(f"architecture {architecture!r} is not supported; supported: {', '.join(table)}")
    return table[architecture]


def config_from_hf(config):
    """A Hugging Face config.json (a dict, a file, or a directory holding it) ->
    ModelConfig, through the family its `architectures[0]` names."""
    import os

    from jaxfill.models.config import read_config_json

    if not isinstance(config, dict):
        config = read_config_json(os.fspath(config))
    archs = config.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in _by_architecture():
        raise ConfigError(f"config.json architecture {arch!r} is not supported; "
                          f"supported: {', '.join(architectures())}")
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
    the one-layer model's, plus L - 1 more layers like its one."""
    import dataclasses

    float_config = dataclasses.replace(config, weight_dtype="auto")
    total, layer = _abstract_sizes(float_config)
    return total + (config.num_layers - 1) * sum(math.prod(p.shape) for p in layer)


@functools.lru_cache(maxsize=64)
def _abstract_sizes(config) -> tuple[int, tuple]:
    """(param count of the model cut to one layer, that layer's ParamShapes). The layers
    of a dense family differ only in per-layer settings (models/layer_settings.py), which
    change no shape, so one abstract layer stands for all; eval_shape of one layer costs
    milliseconds where the whole 62-layer model costs seconds."""
    import dataclasses

    import jax
    from flax import nnx

    from jaxfill.models.sharding import var_axes

    one = dataclasses.replace(config, num_layers=1, layer_types=config.layer_types[:1],
                              nope_layers=tuple(n for n in config.nope_layers if n == 0))
    state = nnx.state(nnx.eval_shape(lambda: new_model(one, nnx.Rngs(0))))
    layer = tuple(ParamShape(tuple(path[2:]), tuple(var.shape), tuple(var_axes(var)), var.dtype)
                  for path, var in nnx.to_flat_state(state) if path[:2] == ("layers", 0))
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(state)), layer


class ParamShape(NamedTuple):
    path: tuple  # e.g. ("attn", "q") within a layer
    shape: tuple
    axes: tuple  # logical axis names (models/sharding.py RULES)
    dtype: Any


def layer_params(config) -> tuple[ParamShape, ...]:
    """One decoder layer's params as allocated (int8 projections and their scales
    included), from the model's abstract params: what the planner counts."""
    return _abstract_sizes(config)[1]


def layer_projection_params(config) -> dict[tuple, int]:
    """Weights per projection of one layer (the matmuls a token goes through), float layout."""
    import dataclasses

    from jaxfill.models.quant import QUANTIZED_INPUT_AXES

    float_config = dataclasses.replace(config, weight_dtype="auto")
    return {p.path: math.prod(p.shape) for p in layer_params(float_config) if p.path[-1] in QUANTIZED_INPUT_AXES}
