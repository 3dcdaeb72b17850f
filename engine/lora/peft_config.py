"""adapter_config.json -> each module's rank and scaling, or AdapterError naming the field.

PEFT scales a module's delta by lora_alpha / r (use_rslora: lora_alpha / sqrt(r)), with r
and lora_alpha overridden per module by `rank_pattern` / `alpha_pattern` (regexes over the
module's name; PEFT writes them itself when it splits a fused MoE parameter's rank).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


class AdapterError(ValueError):
    """An adapter this engine cannot serve; the message names the field or tensor."""


def refuse(path: str, what: str) -> AdapterError:
    return AdapterError(f"{path}: {what}")


@dataclasses.dataclass(frozen=True)
class PeftScaling:
    path: str
    r: int
    alpha: float
    rslora: bool
    rank_pattern: dict
    alpha_pattern: dict
    max_rank: int

    def _match(self, patterns: dict, module: str):
        for pattern, value in patterns.items():  # PEFT's rule: the pattern ends the module's name
            if re.fullmatch(rf"(.*\.)?(?:{pattern})", module):
                return value
        return None

    def scaling(self, module: str, rank: int) -> float:
        """The scaling of `module` (e.g. "model.layers.0.mlp.experts.gate_up_proj") whose
        tensors have rank `rank`, checked against the config's rank for it."""
        want = self._match(self.rank_pattern, module) or self.r
        if rank != want:
            raise refuse(self.path, f"{module}: tensors of rank {rank}, the config says r = {want}")
        if rank > self.max_rank:
            raise refuse(self.path, f"{module}: r = {rank} is over lora.max_lora_rank = {self.max_rank}")
        alpha = self._match(self.alpha_pattern, module)
        alpha = self.alpha if alpha is None else float(alpha)
        return alpha / math.sqrt(rank) if self.rslora else alpha / rank


def read_config(path: str, max_rank: int) -> PeftScaling:
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise refuse(path, f"no {CONFIG_FILE} (a PEFT LoRA adapter directory has {CONFIG_FILE} and {WEIGHTS_FILE})")
    with open(file) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise refuse(path, f"peft_type {cfg.get('peft_type')!r} is not LORA")
    refusals = (("use_dora", "DoRA"), ("lora_bias", "lora_bias"), ("modules_to_save", "modules_to_save"),
                ("trainable_token_indices", "trainable_token_indices"))
    for key, what in refusals:
        if cfg.get(key):
            raise refuse(path, f"{key} = {cfg[key]!r}: {what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise refuse(path, f"bias = {cfg['bias']!r}: biases are not supported (bias = none)")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise refuse(path, f"r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise refuse(path, f"r = {r} is over lora.max_lora_rank = {max_rank}")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise refuse(path, f"lora_alpha must be a number, got {alpha!r}")
    patterns = {}
    for key in ("rank_pattern", "alpha_pattern"):
        value = cfg.get(key) or {}
        if not isinstance(value, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                                                  for v in value.values()):
            raise refuse(path, f"{key} must map module patterns to positive numbers, got {value!r}")
        patterns[key] = value
    return PeftScaling(path, r, float(alpha), bool(cfg.get("use_rslora")), patterns["rank_pattern"],
                       patterns["alpha_pattern"], max_rank)
