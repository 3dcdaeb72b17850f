"""The registry: `config.json`'s `architectures[0]` -> its family module.

Adding a family is one module here with a FAMILIES tuple, listed in MODULES, and its
test; nothing in engine/ or serving/ names a family.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from jaxfill.models.config import ConfigError

MODULES = ("llama", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "smollm3", "granite")


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


def from_hf(config: dict[str, Any]):
    """A Hugging Face config.json (as a dict) -> ModelConfig, through its family."""
    archs = config.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in _by_architecture():
        raise ConfigError(f"config.json architecture {arch!r} is not supported; "
                          f"supported: {', '.join(architectures())}")
    return family_of(arch).to_model_config(config, arch)


def new_model(config, rngs=None, **kwargs):
    """The family's model class, built (rngs=None: seeded from config.seed)."""
    return config.family.model_class()(config, rngs, **kwargs)


@functools.lru_cache(maxsize=64)
def param_count(config) -> int:
    """Parameters of the model, counted from its abstract params (int8 scales excluded)."""
    import dataclasses
    import math

    import jax
    from flax import nnx

    float_config = dataclasses.replace(config, weight_dtype="auto")
    state = nnx.state(nnx.eval_shape(lambda: new_model(float_config, nnx.Rngs(0))))
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(state))
