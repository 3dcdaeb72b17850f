"""A PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) -> host arrays in
the slot tables' layout (models/lora.py), checked against the model before anything
reaches the device.

PEFT's Linear LoRA adds  scaling * (x A^T) B^T  to  x W^T,  A [r, in], B [out, r],
scaling = lora_alpha / r (use_rslora: lora_alpha / sqrt(r)). Here A becomes [in..., R] and
B [R, out...] (the base weight's own dims: q's out is [heads, head_dim], o's in too),
zero-padded to lora.max_lora_rank R, the scaling folded into B. What PEFT can express and
this does not serve is refused by name: DoRA, biases, modules_to_save, embedding or
lm_head targets, rank / alpha patterns, unknown modules or parameters, a rank over
max_lora_rank. A MoE layer's fused experts (PEFT target_parameters `mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`) are served per expert (`expert_tables`).
"""

from __future__ import annotations

import dataclasses
import os
import re

import numpy as np

from jaxfill.engine.lora.peft_config import WEIGHTS_FILE, AdapterError, PeftScaling, read_config, refuse
from jaxfill.models.lora import PEFT_NAMES

__all__ = ["Adapter", "AdapterError", "read_adapter"]

_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_KIND = {"self_attn": "attn", "mlp": "mlp"}
# PEFT target_parameters on a MoE layer's fused experts (transformers' experts.gate_up_proj
# [E, 2I, H] and experts.down_proj [E, H, I]): one ParamWrapper per parameter, nested, so the
# names only say the depth; which is which follows from lora_A's input width (H or I)
_EXPERTS = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.mlp\.experts((?:\.base_layer)*)\.lora_([AB])\.weight$")


@dataclasses.dataclass
class Adapter:
    name: str
    path: str
    rank: int  # adapter_config.json's r (rank_pattern may give modules others)
    # (layer, projection) -> (A [in..., R], B [R, out...] scaled), numpy in the model's dtype
    tensors: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.tensors.values())


def read_adapter(name: str, path: str, shapes: dict[tuple[int, str], tuple[tuple, tuple]], max_rank: int,
                 dtype) -> Adapter:
    """`shapes`: (layer, projection) -> (the table's in dims, out dims) for every projection
    the model has tables for (engine/lora/slots.py)."""
    from safetensors.numpy import load_file

    config = read_config(path, max_rank)
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise refuse(path, f"no {WEIGHTS_FILE}")
    raw = load_file(file)
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    experts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in raw.items():
        m = _EXPERTS.match(key)
        if m is not None:
            experts.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = value.astype(np.float32)
            continue
        if "lora_embedding" in key or "embed_tokens" in key or "lm_head" in key:
            raise refuse(path, f"{key}: embedding / lm_head targets are not supported")
        m = _KEY.match(key)
        if m is None:
            raise refuse(path, f"{key}: not a LoRA A/B weight of a layer's attention or MLP projection")
        layer, kind, module, half = int(m.group(1)), _KIND[m.group(2)], m.group(3), m.group(4)
        proj = PEFT_NAMES.get(module)
        if proj is None or (layer, proj) not in shapes:
            served = sorted({PEFT_NAMES_INV.get(p, p) for _, p in shapes})
            raise refuse(path, f"{key}: module {module!r} of layer {layer} has no adapter table in this model "
                                f"(served: {', '.join(served)})")
        halves.setdefault((layer, proj), {})[half] = value.astype(np.float32)
    tensors = {}
    for (layer, depth), ab in experts.items():
        key, value = expert_tables(path, layer, ab, shapes, config, dtype)
        if key in tensors:
            raise refuse(path, f"layer {layer}: two expert adapters of the same projection")
        tensors[key] = value
    for (layer, proj), ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise refuse(path, f"layer {layer} {PEFT_NAMES_INV[proj]}: lora_A and lora_B must both be present")
        a, b = ab["A"], ab["B"]  # [r, in], [out, r]
        shape_in, shape_out, _ = shapes[(layer, proj)]
        n_in, n_out, rank = int(np.prod(shape_in)), int(np.prod(shape_out)), a.shape[0]
        kind = "mlp" if proj in ("gate", "up", "down") else "self_attn"
        scaling = config.scaling(f"model.layers.{layer}.{kind}.{PEFT_NAMES_INV[proj]}", rank)
        max_rank = config.max_rank
        if a.shape != (rank, n_in) or b.shape != (n_out, rank):
            raise refuse(path, f"layer {layer} {PEFT_NAMES_INV[proj]}: lora_A {list(a.shape)} / lora_B "
                                f"{list(b.shape)}, expected [{rank}, {n_in}] / [{n_out}, {rank}]")
        a_t = np.zeros((n_in, max_rank), np.float32)
        a_t[:, :rank] = a.T
        b_t = np.zeros((max_rank, n_out), np.float32)
        b_t[:rank] = b.T * scaling
        tensors[(layer, proj)] = (a_t.reshape(*shape_in, max_rank).astype(dtype),
                                  b_t.reshape(max_rank, *shape_out).astype(dtype))
    if not tensors:
        raise refuse(path, f"{WEIGHTS_FILE} holds no LoRA weights")
    return Adapter(name, path, config.r, tensors)


PEFT_NAMES_INV = {ours: peft for peft, ours in PEFT_NAMES.items()}


def expert_tables(path: str, layer: int, ab: dict, shapes: dict, config: PeftScaling, dtype):
    """One fused expert parameter's adapter -> ((layer, "experts_gate_up" | "experts_down"),
    (A [E, in, R], B [E, R, out...] scaled)). PEFT's ParamWrapper keeps lora_A [r * E, in]
    expert-major and lora_B [out, r * E] expert-minor; expert e adds x A_e^T B_e^T."""
    if set(ab) != {"A", "B"}:
        raise refuse(path, f"layer {layer} experts: lora_A and lora_B must both be present")
    a, b = ab["A"], ab["B"]
    names = [p for p in ("experts_gate_up", "experts_down") if (layer, p) in shapes]
    if not names:
        raise refuse(path, f"layer {layer} experts: this layer has no routed experts")
    fits = [p for p in names if a.shape[1] == shapes[(layer, p)][0][0]]
    if len(fits) != 1:
        raise refuse(path, f"layer {layer} experts: lora_A {list(a.shape)} fits {len(fits)} of the fused expert "
                            "parameters (gate_up_proj, down_proj)")
    proj = fits[0]
    shape_in, shape_out, e = shapes[(layer, proj)]
    n_out, rank, max_rank = int(np.prod(shape_out)), a.shape[0] // e, config.max_rank
    scaling = config.scaling(f"model.layers.{layer}.mlp.experts.{proj.removeprefix('experts_')}_proj", rank)
    if a.shape != (rank * e, shape_in[0]) or b.shape != (n_out, rank * e):
        raise refuse(path, f"layer {layer} {proj}: lora_A {list(a.shape)} / lora_B {list(b.shape)}, expected "
                            f"[{rank * e}, {shape_in[0]}] / [{n_out}, {rank * e}]")
    a_e = a.reshape(e, rank, shape_in[0])  # [E, r, in]
    b_e = b.reshape(n_out, rank, e).transpose(2, 1, 0)  # [E, r, out]
    a_t = np.zeros((e, shape_in[0], max_rank), np.float32)
    a_t[:, :, :rank] = a_e.transpose(0, 2, 1)
    b_t = np.zeros((e, max_rank, n_out), np.float32)
    b_t[:, :rank] = b_e * scaling
    return (layer, proj), (a_t.astype(dtype), b_t.reshape(e, max_rank, *shape_out).astype(dtype))
