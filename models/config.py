"""Model shape and numerics, independent of how the model is served.

`ModelConfig` is the one description of a Llama-family decoder. It is built from a TOML
`[model]` section (`from_dict`) or from a Hugging Face `config.json` (`from_hf`), which
spells several fields in two ways across transformers versions.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax.numpy as jnp

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
WEIGHT_DTYPES = ("auto", "int8")  # auto: projections stored in `dtype`; int8: see models/quant.py


class ConfigError(ValueError):
    """A config value that cannot describe a runnable model."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str = "LlamaForCausalLM"
    vocab_size: int = 320
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # frozen dict items
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    sliding_window: int | None = None
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    tie_word_embeddings: bool = False
    dtype: str = "float32"  # parameter and activation dtype
    weight_dtype: str = "auto"  # projection weights: "auto" (= dtype) or "int8" (w8a16, per-channel f32 scales)
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    tokenizer: str = "byte"  # "byte" or "hf" (tokenizer.json beside the weights)
    seed: int = 0  # random init when no checkpoint is given

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(
                f"unknown architecture {self.architecture!r}; supported: {', '.join(ARCHITECTURES)}"
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ConfigError(f"model.weight_dtype must be one of {list(WEIGHT_DTYPES)}, got {self.weight_dtype!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_heads ({self.num_heads}) must be a multiple of "
                f"model.num_kv_heads ({self.num_kv_heads})"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"model.sliding_window must be positive, got {self.sliding_window}")

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def num_params(self) -> int:
        e, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = e * q + 2 * e * kv + q * e + (q + 2 * kv if self.attention_bias else 0)
        layer = attn + 3 * e * i + 2 * e
        head = 0 if self.tie_word_embeddings else v * e
        return v * e + self.num_layers * layer + e + head

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown [model] keys: {sorted(unknown)}; known: {sorted(known)}")
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = _freeze(d["rope_scaling"])
        if "eos_token_id" in d:
            d["eos_token_id"] = _as_tuple(d["eos_token_id"])
        if d.get("sliding_window") in (0, -1):
            d["sliding_window"] = None
        return cls(**d)

    @classmethod
    def from_hf(cls, config: dict[str, Any] | str | os.PathLike) -> "ModelConfig":
        """Reads a Hugging Face config.json (a dict, a file, or a directory holding it)."""
        if not isinstance(config, dict):
            config = _read_config_json(os.fspath(config))
        archs = config.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in ARCHITECTURES:
            raise ConfigError(
                f"config.json architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
            )
        # transformers >= 5 nests rope settings under rope_parameters; older files use
        # rope_theta + rope_scaling at the top level.
        rope = config.get("rope_parameters") or {}
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        scaling = config.get("rope_scaling") or None
        if scaling is None and rope.get("rope_type", "default") not in ("default", None):
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind in ("default", None):
                scaling = None
            elif kind != "llama3":
                raise ConfigError(f"rope scaling type {kind!r} is not supported (only 'llama3')")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in config]
        if missing:
            raise ConfigError(f"config.json lacks {', '.join(missing)}")
        heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        sliding = config.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not config.get("use_sliding_window", False):
            sliding = None
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
        return cls(
            architecture=arch,
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            rope_theta=float(theta),
            rope_scaling=_freeze(scaling) if scaling else None,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            sliding_window=sliding or None,
            attention_bias=arch == "Qwen2ForCausalLM" or bool(config.get("attention_bias", False)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            dtype=dtype.replace("torch.", "") if dtype.replace("torch.", "") in DTYPES else "float32",
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=_as_tuple(config.get("eos_token_id")),
            tokenizer="hf",
        )


def _read_config_json(path: str) -> dict[str, Any]:
    """A model directory (or its config.json) -> dict; every way it can be wrong is a ConfigError."""
    if not os.path.exists(path):
        raise ConfigError(f"model directory {path!r} does not exist")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"{path!r} has no config.json: --model wants a Hugging Face model directory")
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return config


def _freeze(d: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, v) for k, v in d.items() if not isinstance(v, (dict, list))))


def _as_tuple(x) -> tuple[int, ...]:
    if x is None:
        return ()
    if isinstance(x, (list, tuple)):
        return tuple(int(i) for i in x)
    return (int(x),)
