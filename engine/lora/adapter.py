"""A PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) -> host arrays in
the slot tables' layout (models/lora.py), checked against the model before anything
reaches the device.

PEFT's Linear LoRA adds  scaling * (x A^T) B^T  to  x W^T,  A [r, in], B [out, r],
scaling = lora_alpha / r (use_rslora: lora_alpha / sqrt(r)). Here A becomes [in..., R] and
B [R, out...] (the base weight's own dims: q's out is [heads, head_dim], o's in too),
zero-padded to lora.max_lora_rank R, the scaling folded into B. What PEFT can express and
this does not serve is refused by name: DoRA, biases, modules_to_save, embedding or
lm_head targets, expert parameters (target_parameters), rank / alpha patterns, unknown
modules, a rank over max_lora_rank.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import numpy as np

from jaxfill.models.lora import PEFT_NAMES

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_KIND = {"self_attn": "attn", "mlp": "mlp"}


class AdapterError(ValueError):
    """An adapter this engine cannot serve; the message names the field or tensor."""


@dataclasses.dataclass
class Adapter:
    name: str
    path: str
    rank: int
    scaling: float
    # (layer, projection) -> (A [in..., R], B [R, out...] scaled), numpy in the model's dtype
    tensors: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.tensors.values())


def _refuse(path: str, what: str) -> AdapterError:
    return AdapterError(f"{path}: {what}")


def read_config(path: str, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) from adapter_config.json, or AdapterError naming the field."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise _refuse(path, f"no {CONFIG_FILE} (a PEFT LoRA adapter directory has {CONFIG_FILE} and {WEIGHTS_FILE})")
    with open(file) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _refuse(path, f"peft_type {cfg.get('peft_type')!r} is not LORA")
    refusals = (("use_dora", "DoRA"), ("lora_bias", "lora_bias"), ("modules_to_save", "modules_to_save"),
                ("target_parameters", "target_parameters (expert parameters)"), ("rank_pattern", "rank_pattern"),
                ("alpha_pattern", "alpha_pattern"), ("trainable_token_indices", "trainable_token_indices"))
    for key, what in refusals:
        if cfg.get(key):
            raise _refuse(path, f"{key} = {cfg[key]!r}: {what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise _refuse(path, f"bias = {cfg['bias']!r}: biases are not supported (bias = none)")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise _refuse(path, f"r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise _refuse(path, f"r = {r} is over lora.max_lora_rank = {max_rank}")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise _refuse(path, f"lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(scaling)


def read_adapter(name: str, path: str, shapes: dict[tuple[int, str], tuple[tuple, tuple]], max_rank: int,
                 dtype) -> Adapter:
    """`shapes`: (layer, projection) -> (the table's in dims, out dims) for every projection
    the model has tables for (engine/lora/slots.py)."""
    from safetensors.numpy import load_file

    rank, scaling = read_config(path, max_rank)
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise _refuse(path, f"no {WEIGHTS_FILE}")
    raw = load_file(file)
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in raw.items():
        if "lora_embedding" in key or "embed_tokens" in key or "lm_head" in key:
            raise _refuse(path, f"{key}: embedding / lm_head targets are not supported")
        m = _KEY.match(key)
        if m is None:
            raise _refuse(path, f"{key}: not a LoRA A/B weight of a layer's attention or MLP projection")
        layer, kind, module, half = int(m.group(1)), _KIND[m.group(2)], m.group(3), m.group(4)
        proj = PEFT_NAMES.get(module)
        if proj is None or (layer, proj) not in shapes:
            raise _refuse(path, f"{key}: module {module!r} of layer {layer} has no adapter table in this model "
                                f"(served: {', '.join(sorted({PEFT_NAMES_INV[p] for _, p in shapes}))})")
        halves.setdefault((layer, proj), {})[half] = value.astype(np.float32)
    tensors = {}
    for (layer, proj), ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise _refuse(path, f"layer {layer} {PEFT_NAMES_INV[proj]}: lora_A and lora_B must both be present")
        a, b = ab["A"], ab["B"]  # [r, in], [out, r]
        shape_in, shape_out = shapes[(layer, proj)]
        n_in, n_out = int(np.prod(shape_in)), int(np.prod(shape_out))
        if a.shape != (rank, n_in) or b.shape != (n_out, rank):
            raise _refuse(path, f"layer {layer} {PEFT_NAMES_INV[proj]}: lora_A {list(a.shape)} / lora_B "
                                f"{list(b.shape)}, expected [{rank}, {n_in}] / [{n_out}, {rank}]")
        a_t = np.zeros((n_in, max_rank), np.float32)
        a_t[:, :rank] = a.T
        b_t = np.zeros((max_rank, n_out), np.float32)
        b_t[:rank] = b.T * scaling
        tensors[(layer, proj)] = (a_t.reshape(*shape_in, max_rank).astype(dtype),
                                  b_t.reshape(max_rank, *shape_out).astype(dtype))
    if not tensors:
        raise _refuse(path, f"{WEIGHTS_FILE} holds no LoRA weights")
    return Adapter(name, path, rank, scaling, tensors)


PEFT_NAMES_INV = {ours: peft for peft, ours in PEFT_NAMES.items()}
