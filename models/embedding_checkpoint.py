"""What an embedding or reranking checkpoint says beyond config.json.

sentence-transformers publishes a model as a pipeline of modules (`modules.json`): the
transformer, a `Pooling` module (`1_Pooling/config.json`: which rows make the vector) and
often a `Normalize` module (L2). Embedding backbones such as Qwen3-Embedding-4B also drop
the LM head (no `lm_head.weight`, untied), so the model is built without one. Both are read
here at config time, before any weight, so an override (`model.pooling`, ...) still wins.
Prompts from `config_sentence_transformers.json` are not applied: callers put any
instruction into the text themselves.
"""

from __future__ import annotations

import json
import os

from jaxfill.models.config import ConfigError
from jaxfill.models.safetensors_file import read_safetensors, safetensors_files

# sentence-transformers' Pooling flags -> model.pooling (one of them, alone)
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_UNBUILT = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")


def _read_json(path: str):
    with open(path) as f:
        return json.load(f)


def sentence_transformers_fields(model_dir: str) -> dict:
    """Flat model keys from modules.json (pooling, normalize_embeddings); {} when absent.
    A module that would change the vector in a way not built here (Dense, max pooling)
    is refused rather than skipped."""
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return {}
    fields = {"normalize_embeddings": False}
    for module in _read_json(modules_path):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _KNOWN_MODULES:
            raise ConfigError(f"{modules_path}: module {module.get('type')!r} is not built (only "
                              f"{', '.join(_KNOWN_MODULES)}); set model.pooling to embed without it")
        if kind == "Normalize":
            fields["normalize_embeddings"] = True
        if kind == "Pooling":
            cfg = _read_json(os.path.join(model_dir, module.get("path") or "1_Pooling", "config.json"))
            chosen = [mode for flag, mode in _MODES.items() if cfg.get(flag)]
            unbuilt = [flag for flag in _UNBUILT if cfg.get(flag)]
            if unbuilt or len(chosen) != 1:
                raise ConfigError(f"{model_dir}: pooling {unbuilt + chosen} is not built; one of last, mean, cls "
                                  "is (set model.pooling)")
            fields["pooling"] = chosen[0]
    return fields


def has_lm_head(model_dir: str, tied: bool) -> bool:
    """False for an untied checkpoint without `lm_head.weight` (an embedding backbone)."""
    if tied:
        return True
    if not any(os.path.exists(os.path.join(model_dir, n)) for n in ("model.safetensors",
                                                                    "model.safetensors.index.json")):
        return True  # no safetensors (a GGUF, random init): nothing says the head is absent
    files = safetensors_files(model_dir)
    return any(name == "lm_head.weight" for path in files for name, _ in read_safetensors(path))
