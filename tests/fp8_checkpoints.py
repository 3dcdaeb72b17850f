"""FP8 block-scaled checkpoints written as the published ones are (DeepSeek V3, Qwen3-FP8):
each Linear projection `<name>.weight` [out, in] stored as float8 with `<name>.weight_scale_inv`
f32 [ceil(out / B0), ceil(in / B1)], partial edge blocks included; embeddings, norms, the LM
head and routers unconverted; `quantization_config` {quant_method: fp8, weight_block_size}.
Written from a random-init HF checkpoint (tests/hf_models.py), together with its
dequantized f32 twin: HF runs that one as the reference.

The values are quantized here from the format's definition (block amax / fp8 max, numpy
loops over blocks), not with models/fp8_block.py."""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
import torch
from safetensors.numpy import load_file
from safetensors.torch import save_file

FP8 = {"float8_e4m3fn": (ml_dtypes.float8_e4m3fn, torch.float8_e4m3fn),
       "float8_e5m2": (ml_dtypes.float8_e5m2, torch.float8_e5m2)}


def is_projection(name: str, value: np.ndarray) -> bool:
    return value.ndim == 2 and name.endswith(("_proj.weight", "kv_a_proj_with_mqa.weight"))


def quantize_blocks(w: np.ndarray, block: tuple, fp8) -> tuple[np.ndarray, np.ndarray]:
    """[out, in] f32 -> (fp8 [out, in], scale_inv [ceil(out / B0), ceil(in / B1)])."""
    (n_out, n_in), (b0, b1) = w.shape, block
    q = np.zeros(w.shape, fp8)
    scales = np.ones((-(-n_out // b0), -(-n_in // b1)), np.float32)
    top = float(ml_dtypes.finfo(fp8).max)
    for r in range(scales.shape[0]):
        for c in range(scales.shape[1]):
            tile = w[r * b0:(r + 1) * b0, c * b1:(c + 1) * b1].astype(np.float32)
            amax = float(np.abs(tile).max())
            scales[r, c] = np.float32(amax / top) if amax > 0 else np.float32(1)
            q[r * b0:(r + 1) * b0, c * b1:(c + 1) * b1] = (tile / scales[r, c]).astype(fp8)
    return q, scales


def dequantize_blocks(q: np.ndarray, scales: np.ndarray, block: tuple) -> np.ndarray:
    (n_out, n_in), (b0, b1) = q.shape, block
    s = np.repeat(np.repeat(scales, b0, axis=0), b1, axis=1)[:n_out, :n_in]
    return q.astype(np.float32) * s


def write_fp8(plain: str, out: str, block: tuple, fmt: str = "float8_e4m3fn", quant: dict | None = None) -> str:
    """`out`: the fp8 checkpoint of `plain`; `out` + "_ref": its dequantized f32 twin."""
    np_fp8, torch_fp8 = FP8[fmt]
    tensors = load_file(os.path.join(plain, "model.safetensors"))
    fp8, ref = {}, {}
    for name, value in tensors.items():
        if is_projection(name, value):
            q, scales = quantize_blocks(value, block, np_fp8)
            fp8[name] = torch.from_numpy(q.view(np.uint8)).view(torch_fp8)
            fp8[name[:-len(".weight")] + ".weight_scale_inv"] = torch.from_numpy(scales)
            ref[name] = torch.from_numpy(dequantize_blocks(q, scales, block))
        else:
            fp8[name] = ref[name] = torch.from_numpy(np.ascontiguousarray(value))
    for directory, data in ((out, fp8), (out + "_ref", ref)):
        shutil.copytree(plain, directory)
        save_file(data, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quant or {"quant_method": "fp8", "activation_scheme": "dynamic",
                                              "weight_block_size": list(block)}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


def write_ct_fp8(plain: str, out: str, strategy: str, block: tuple | None = None,
                 scale_dtype=torch.bfloat16) -> str:
    """`out`: `plain` as compressed-tensors' float-quantized W8A8 (llm-compressor's FP8_DYNAMIC
    for `channel`, FP8 for `tensor`, FP8_BLOCK for `block`), scales in bf16 as llm-compressor
    stores them (or `scale_dtype`: f32 ones transformers' own loader dequantizes exactly); fp8 values, packing and the dequantized twin (`out` + "_ref", f32) by the
    compressed-tensors library's FloatQuantizationCompressor. The scales here: amax / 448
    over the strategy's blocks."""
    from compressed_tensors.compressors import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    extra = {"block_structure": list(block)} if strategy == "block" else {}
    scheme = QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy,
                                                     **extra),
        input_activations=QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True))
    tensors = load_file(os.path.join(plain, "model.safetensors"))
    fp8, ref = {}, {}
    for name, value in tensors.items():
        if not is_projection(name, value):
            fp8[name] = ref[name] = torch.from_numpy(np.ascontiguousarray(value))
            continue
        w = torch.from_numpy(value.astype(np.float32))
        if strategy == "channel":
            amax = w.abs().amax(1, keepdim=True)
        elif strategy == "tensor":
            amax = w.abs().amax().reshape(1)
        else:
            b0, b1 = block
            amax = torch.from_numpy(np.array([[np.abs(value[r:r + b0, c:c + b1]).max()
                                               for c in range(0, value.shape[1], b1)]
                                              for r in range(0, value.shape[0], b0)], np.float32))
        scale = (amax / 448.0).to(scale_dtype)
        stored = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
        stem = name[:-len("weight")]
        fp8.update({stem + k: v.contiguous() for k, v in stored.items()})
        exact = {"weight": stored["weight"], "weight_scale": stored["weight_scale"].float()}
        ref[name] = FloatQuantizationCompressor.decompress(exact, scheme)["weight"].float().contiguous()
    for directory, data in ((out, fp8), (out + "_ref", ref)):
        shutil.copytree(plain, directory)
        save_file(data, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    quant = QuantizationConfig(config_groups={"group_0": scheme}, format="float-quantized", ignore=["lm_head"],
                               quantization_status="compressed")
    config["quantization_config"] = json.loads(json.dumps(quant.model_dump(), default=str))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out
