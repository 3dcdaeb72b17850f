"""config.json's compressed-tensors `float-quantized` quantization_config (llm-compressor's
FP8 / FP8_DYNAMIC / FP8_BLOCK schemes: W8A8 with fp8 e4m3 weights) -> the ModelConfig
fields that keep the weights in fp8 on the device (models/fp8_block.py).

Each Linear weight is stored as `weight` float8_e4m3fn [out, in] with `weight_scale` in the
checkpoint's dtype: [out, 1] for the `channel` strategy (block (1, 0): one scale a row),
[1] for `tensor` (block (0, 0)), [ceil(out / B0), ceil(in / B1)] for `block` with its
`block_structure`. W = f32(weight) * scale, as compressed-tensors' decompressor computes
it. The activations' fp8 quantization (dynamic per token, or static `input_scale`) is not
run: the matmul is weight-only on every backend here, so the numbers are those of the
decompressed model. Every key is read, known to change nothing we compute, or refused by
name."""

from __future__ import annotations

from typing import Any

from jaxfill.models.config.errors import ConfigError
from jaxfill.models.config.int_quantization import refuse_unreproduced_ct

KEYS = {"quant_method", "config_groups", "format", "ignore", "quantization_status", "kv_cache_scheme",
        "global_compression_ratio", "sparsity_config", "transform_config", "version", "moe_sparsity_config"}
WEIGHT_KEYS = {"num_bits", "type", "symmetric", "strategy", "group_size", "dynamic", "actorder", "observer",
               "observer_kwargs", "block_structure", "scale_dtype", "zp_dtype"}
GROUP_KEYS = {"targets", "weights", "input_activations", "output_activations", "format"}
BLOCKS = {"channel": (1, 0), "tensor": (0, 0)}


def _refuse(key: str, value, why: str) -> ConfigError:
    return ConfigError(f"config.json quantization_config.{key}={value!r} is not supported ({why})")


def ct_fp8_fields(quant: dict[str, Any]) -> dict[str, Any]:
    """weight_dtype fp8_block, weight_fp8 e4m3, weight_block_size from the weights' strategy."""
    for key, value in quant.items():
        if key not in KEYS:
            raise ConfigError(f"config.json quantization_config.{key} (= {value!r}) is not understood for "
                              "compressed-tensors float-quantized; jaxfill refuses what it cannot reproduce")
    refuse_unreproduced_ct(quant)
    ignore = [] if quant.get("ignore") is None else list(quant["ignore"])
    if any(n not in ("lm_head", "re:.*lm_head", "re:lm_head") for n in ignore):
        raise _refuse("ignore", ignore, "every Linear but the LM head in fp8: no per-module fallback")
    groups = quant.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse("config_groups", sorted(groups), "exactly one group")
    name, group = next(iter(groups.items()))
    where = f"config_groups.{name}"
    for key, value in group.items():
        if key not in GROUP_KEYS:
            raise ConfigError(f"config.json quantization_config.{where}.{key} (= {value!r}) is not understood")
    if group.get("targets") != ["Linear"]:
        raise _refuse(f"{where}.targets", group.get("targets"), "['Linear']")
    if group.get("output_activations"):
        raise _refuse(f"{where}.output_activations", group["output_activations"], "not reproduced")
    if group.get("format") not in (None, "float-quantized"):
        raise _refuse(f"{where}.format", group["format"], "float-quantized")
    act = group.get("input_activations")
    if act and (act.get("type") != "float" or act.get("num_bits") != 8):
        raise _refuse(f"{where}.input_activations", act, "fp8 activations (run weight-only here) or none")
    w = group.get("weights") or {}
    for key, value in w.items():
        if key not in WEIGHT_KEYS:
            raise ConfigError(f"config.json quantization_config.{where}.weights.{key} (= {value!r}) is not "
                              "understood; jaxfill refuses what it cannot reproduce")
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise _refuse(f"{where}.weights", {k: w.get(k) for k in ("type", "num_bits")}, "8-bit float weights (e4m3)")
    if w.get("symmetric", True) is not True or w.get("dynamic"):
        raise _refuse(f"{where}.weights", {k: w.get(k) for k in ("symmetric", "dynamic")},
                      "symmetric static weight scales")
    strategy = w.get("strategy")
    if strategy == "block":
        block = w.get("block_structure")
        if not isinstance(block, (list, tuple)) or len(block) != 2 or not all(isinstance(b, int) and b > 0
                                                                              for b in block):
            raise _refuse(f"{where}.weights.block_structure", block, "two positive sizes")
        return dict(weight_dtype="fp8_block", weight_fp8="float8_e4m3fn", weight_block_size=tuple(block))
    if strategy not in BLOCKS:
        raise _refuse(f"{where}.weights.strategy", strategy, "channel, tensor or block")
    return dict(weight_dtype="fp8_block", weight_fp8="float8_e4m3fn", weight_block_size=BLOCKS[strategy])
