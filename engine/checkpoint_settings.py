"""Engine settings for a checkpoint run without a preset (`--model DIR`, no `--config`).

Before this, such a run silently took the tiny model's preset: a 4096-token context for an
8192-position model, a fixed 1024-page pool, 16 sequences, and the name "tiny" in logs and
plans. A checkpoint now brings its own: the context its positions allow, a pool sized from
device memory, the batch limits every shipped preset of a published model uses, and its
own name. An explicit `--config` (or `Engine.from_config("tiny", model_path=...)`) keeps
that preset's settings, and `--set` / `overrides=` always win.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from jaxfill.engine.presets import preset_names, read_preset
from jaxfill.models.config import ModelConfig, read_config_json
from jaxfill.models.families.registry import config_from_dict, family_of
from jaxfill.models.gguf import gguf_file

log = logging.getLogger("jaxfill.config")

# What most shipped presets of published models set (configs/llama3_8b.toml, qwen3_8b.toml, ...):
# num_pages = 0 sizes the pool from what device memory holds after the weights
# (engine/memory.py), 64 sequences a step, an 8192-token step budget; and decode buckets of
# 1, 2, 4, 8 tokens, so a decode of a few rows is not padded to 16 (benchmarks/RESULTS.md,
# "Decode buckets on SmolLM2-135M").
CHECKPOINT_ENGINE = {"num_pages": 0, "max_num_seqs": 64, "max_num_batched_tokens": 8192,
                     "decode_buckets": [1, 2, 4, 8]}
# What a preset must share with a checkpoint to be offered for it: the family and the
# shapes, and the positions (Llama 3 and 3.1 differ only there and in the rope).
MATCHED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "max_position_embeddings", "rope_theta", "rope_scaling", "num_experts",
                  "experts_per_token", "moe_intermediate_size", "kv_lora_rank", "linear_layers")


def checkpoint_engine(model: ModelConfig) -> dict[str, Any]:
    """The [engine] section a checkpoint stands in for: its full context (as the presets
    give theirs: vLLM's default too; `--set engine.max_model_len=N` for less), the rest
    from CHECKPOINT_ENGINE."""
    return {**CHECKPOINT_ENGINE, "max_model_len": int(model.max_position_embeddings)}


def checkpoint_name(model_path: str) -> str:
    """The name in logs and plans: config.json's `_name_or_path` (or `_model_name_or_path`),
    which transformers writes as the hub id it loaded from ("meta-llama/Meta-Llama-3-8B");
    a local path there gives its last part; without either, the directory's name."""
    path = os.path.normpath(os.path.abspath(model_path))
    directory = os.path.dirname(path) if os.path.isfile(path) else path
    gguf = gguf_file(model_path)
    if gguf:  # a GGUF's file name says which quantization it is ("SmolLM2-135M-Instruct.Q4_1")
        return os.path.splitext(os.path.basename(gguf))[0]
    try:
        hf = read_config_json(model_path)
    except ValueError:
        hf = {}
    for key in ("_name_or_path", "_model_name_or_path"):
        value = hf.get(key)
        if isinstance(value, str) and value.strip():
            value = value.strip()
            local = os.path.isabs(value) or value.startswith((".", "~"))
            return os.path.basename(os.path.normpath(value)) if local else value.rstrip("/")
    return os.path.basename(directory)


def matching_preset(model: ModelConfig) -> str | None:
    """The shipped preset whose [model] is this model's family, shapes and positions, if
    any: `--config NAME` would then apply the engine settings tuned for it."""
    family = family_of(model.architecture).name
    for name in preset_names():
        section = read_preset(name)[1].get("model", {})
        try:
            preset = config_from_dict(section)
        except ValueError:
            continue
        if family_of(preset.architecture).name == family and all(
                preset.value(f) == model.value(f) for f in MATCHED_FIELDS):
            return name
    return None


def describe(name: str, model: ModelConfig, engine: dict[str, Any]) -> None:
    """One log line of the engine settings a checkpoint run gets (`engine`: the checkpoint's
    with the overrides on top), one more naming a matching preset."""
    pool = f"{engine['num_pages']} pages" if engine["num_pages"] else "sized from device memory"
    log.info("%s: engine settings from the checkpoint (no --config): max_model_len %d (positions %d), "
             "KV pool %s, max_num_seqs %d, token budget %d", name, engine["max_model_len"],
             model.max_position_embeddings, pool, engine["max_num_seqs"], engine["max_num_batched_tokens"])
    preset = matching_preset(model)
    if preset:
        log.info("%s matches the shipped preset %s: --config %s applies its tuned engine settings",
                 name, preset, preset)
