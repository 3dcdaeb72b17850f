"""Integer group-quantized checkpoints written as the published ones are: GPTQ (v1 and v2
packing, desc_act false and true with a permuted g_idx), AWQ GEMM (its interleaved
nibbles) and compressed-tensors (pack-quantized W4A16 / W8A16 and int-quantized W8A8,
packed by the `compressed-tensors` library itself), from a random-init HF checkpoint
(tests/hf_models.py), together with the dequantized f32 twin HF runs as the reference.

Codes, scales and zero points come from each format's definition here (min/max over a
group, numpy), packed by loops over the format's bit layout, not with jaxfill's readers."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import torch
from safetensors.numpy import load_file
from safetensors.torch import save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
# name -> (writer, bits, group size (-1: per channel), zero points, extra)
FORMATS = {
    "gptq": ("gptq", 4, 32, True, {}),
    "gptq_act_order": ("gptq", 4, 32, False, {"desc_act": True}),
    "gptq_v2_8bit": ("gptq", 8, 64, True, {"checkpoint_format": "gptq_v2"}),
    "awq": ("awq", 4, 64, True, {}),
    "awq_128": ("awq", 4, 128, True, {}),
    "ct_w4a16": ("ct", 4, 32, False, {"format": "pack-quantized"}),
    "ct_w4a16_asym": ("ct", 4, 128, True, {"format": "pack-quantized"}),
    "ct_w8a16": ("ct", 8, 128, False, {"format": "pack-quantized"}),
    "ct_w8a8": ("ct", 8, -1, False, {"format": "int-quantized"}),
    # mixtures of experts (each expert's projections quantized on their own): groups of 16
    # keep the 32-wide experts whole under mesh.tensor = 2
    "ct_w4a16_g16": ("ct", 4, 16, False, {"format": "pack-quantized"}),
    "gptq_g16": ("gptq", 4, 16, True, {}),
    # Kimi K2-Thinking's: routed experts alone in W4A16 groups of 32, the rest left in the ignore list
    "ct_experts_only": ("ct", 4, 32, False, {"format": "pack-quantized", "ignore": KIMI_IGNORE}),
}


def is_projection(name: str, value: np.ndarray) -> bool:
    return value.ndim == 2 and name.endswith("_proj.weight")


def group_params(w: np.ndarray, bits: int, group: int, zero_point: bool, g_idx: np.ndarray):
    """[out, in] f32 -> unsigned codes Q [out, in], S, Z [groups, out] f32 (W ~ (Q - Z[g]) S[g])."""
    n_out, n_in = w.shape
    n_groups = int(g_idx.max()) + 1
    top = 2 ** bits - 1
    s, z = np.ones((n_groups, n_out), np.float32), np.zeros((n_groups, n_out), np.float32)
    for g in range(n_groups):
        cols = w[:, g_idx == g]
        if zero_point:
            lo, hi = np.minimum(cols.min(axis=1), 0), np.maximum(cols.max(axis=1), 0)
            s[g] = np.where(hi > lo, (hi - lo) / top, 1)
            z[g] = np.clip(np.round(-lo / s[g]), 1, top)  # 1..: GPTQ v1 stores z - 1 in bits
        else:
            half = 2 ** (bits - 1)
            s[g] = np.maximum(np.abs(cols).max(axis=1), 1e-8) / (half - 1)
            z[g] = half
    q = np.clip(np.round(w / s[g_idx].T) + z[g_idx].T, 0, top).astype(np.int64)
    return q, s, z


def dequantize(q, s, z, g_idx) -> np.ndarray:  # -> [out, in] f32
    return ((q.astype(np.float32) - z[g_idx].T) * s[g_idx].T).astype(np.float32)


def pack_along(values: np.ndarray, bits: int, axis: int, order=None) -> np.ndarray:
    """Codes (< 2^bits) -> int32 words of 32 / bits codes along `axis`, code j of a word
    at bits [j * bits, (j + 1) * bits); `order[j]`: which of the word's codes goes there."""
    per = 32 // bits
    v = np.moveaxis(values.astype(np.uint64), axis, -1)
    words = np.zeros(v.shape[:-1] + (v.shape[-1] // per,), np.uint64)
    for w in range(words.shape[-1]):
        for j in range(per):
            src = w * per + (order[j] if order else j)
            words[..., w] |= v[..., src] << np.uint64(j * bits)
    return np.moveaxis(words.astype(np.uint32).view(np.int32), -1, axis)


def _gptq(w, bits, group, zero_point, extra, rng):
    n_out, n_in = w.shape
    g_idx = np.arange(n_in) // group
    if extra.get("desc_act"):  # quantized in a permuted input order, groups of it in g_idx
        perm = rng.permutation(n_in)
        g_idx = np.empty(n_in, np.int64)
        g_idx[perm] = np.arange(n_in) // group
    q, s, z = group_params(w, bits, group, zero_point, g_idx)
    s = s.astype(np.float16).astype(np.float32)  # stored in f16, the reference uses those values
    q = np.clip(np.round(w / s[g_idx].T) + z[g_idx].T, 0, 2 ** bits - 1).astype(np.int64)
    v1 = extra.get("checkpoint_format", "gptq") == "gptq"
    stored = {"qweight": pack_along(q.T, bits, 0), "qzeros": pack_along(z.astype(np.int64) - v1, bits, 1),
              "scales": s.astype(np.float16), "g_idx": g_idx.astype(np.int32)}
    return stored, dequantize(q, s, z, g_idx)


def _awq(w, bits, group, zero_point, extra, rng):
    g_idx = np.arange(w.shape[1]) // group
    q, s, z = group_params(w, bits, group, zero_point, g_idx)
    s = s.astype(np.float16).astype(np.float32)
    q = np.clip(np.round(w / s[g_idx].T) + z[g_idx].T, 0, 2 ** bits - 1).astype(np.int64)
    stored = {"qweight": pack_along(q.T, bits, 1, AWQ_ORDER), "qzeros": pack_along(z.astype(np.int64), bits, 1,
                                                                                  AWQ_ORDER),
              "scales": s.astype(np.float16)}
    return stored, dequantize(q, s, z, g_idx)


def _ct_scheme(bits, group, zero_point, fmt):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    strategy = dict(strategy="channel") if group == -1 else dict(strategy="group", group_size=group)
    acts = None
    if fmt == "int-quantized":  # W8A8: dynamic per-token int8 activations (run weight-only by jaxfill)
        acts = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=bits, type="int",
                                                                           symmetric=not zero_point, **strategy),
                              input_activations=acts)


def _ct(w, bits, group, zero_point, extra, rng):
    """Scales and zero points from the min/max grid; codes, packing and the dequantized
    reference by the compressed-tensors library (its compressor for the format)."""
    from compressed_tensors.compressors import IntQuantizationCompressor, PackedQuantizationCompressor

    n_out, n_in = w.shape
    g = n_in if group == -1 else group
    g_idx = np.arange(n_in) // g
    _, s, z = group_params(w, bits, g, zero_point, g_idx)
    half = 2 ** (bits - 1)
    scheme = _ct_scheme(bits, group, zero_point, extra["format"])
    state = {"weight": torch.from_numpy(w), "weight_scale": torch.from_numpy(np.ascontiguousarray(s.T)),
             "weight_zero_point": torch.from_numpy(np.ascontiguousarray((z.T - half).astype(np.int8)))}
    compressor = PackedQuantizationCompressor if extra["format"] == "pack-quantized" else IntQuantizationCompressor
    stored = compressor.compress(state, scheme)
    ref = compressor.decompress(stored, scheme)["weight"].float().numpy()
    stored = {k: v.numpy() for k, v in stored.items()}
    return stored, ref


def quant_config(name: str) -> dict:
    kind, bits, group, zero_point, extra = FORMATS[name]
    if kind == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": bool(extra.get("desc_act")),
                "sym": not zero_point, "true_sequential": True, "damp_percent": 0.01, "static_groups": False,
                "checkpoint_format": extra.get("checkpoint_format", "gptq"), "model_name_or_path": None,
                "model_file_base_name": None}
    if kind == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    from compressed_tensors.quantization import QuantizationConfig

    scheme = _ct_scheme(bits, group, zero_point, extra["format"])
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=extra["format"],
                                ignore=extra.get("ignore", ["lm_head"]), quantization_status="compressed")
    return json.loads(json.dumps(config.model_dump(), default=str))


def write_int(plain: str, out: str, name: str, seed: int = 0) -> str:
    """`out`: the `name` (a key of FORMATS) checkpoint of `plain`; `out` + "_ref": its
    dequantized f32 twin."""
    kind, bits, group, zero_point, extra = FORMATS[name]
    writer = {"gptq": _gptq, "awq": _awq, "ct": _ct}[kind]
    rng = np.random.default_rng(seed)
    tensors = load_file(os.path.join(plain, "model.safetensors"))
    packed, ref = {}, {}
    for key, value in tensors.items():
        if is_projection(key, value) and (".experts." in key or "ignore" not in extra):
            stored, deq = writer(value.astype(np.float32), bits, group, zero_point, extra, rng)
            stem = key[:-len("weight")]
            packed.update({stem + suffix: torch.from_numpy(np.ascontiguousarray(v)) for suffix, v in stored.items()})
            ref[key] = torch.from_numpy(np.ascontiguousarray(deq))
        else:
            packed[key] = ref[key] = torch.from_numpy(np.ascontiguousarray(value))
    for directory, data in ((out, packed), (out + "_ref", ref)):
        shutil.copytree(plain, directory)
        save_file(data, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quant_config(name)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out
