"""config.json's `quantization_config` for FP8 block-scaled checkpoints (`quant_method: fp8`,
transformers' FineGrainedFP8Config) -> the ModelConfig fields that load them kept in fp8
(models/fp8_block.py). Every key is read or refused by name: a setting that would change
the numbers is never skipped."""

from __future__ import annotations

from typing import Any

from jaxfill.models.config.errors import ConfigError

FMT = {"e4m3": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn", "e5m2": "float8_e5m2",
       "float8_e5m2": "float8_e5m2"}
# accepted only at these values: per-block f32 scales of fp8 weights, nothing else converted
FIXED = {"scale_fmt": ("float",), "expert_dtype": ("fp8",), "modules_to_convert": (None, [])}
# activation_scheme: static input scales serve fp8 x fp8 matmuls; weight-only here, as
# transformers' dequantize=True. modules_to_not_convert (MiniMax: ignored_layers): those
# tensors are stored unquantized and load as they are.
READ = {"quant_method", "weight_block_size", "activation_scheme", "fmt", "dequantize", "modules_to_not_convert",
        "ignored_layers"}


def is_fp8(hf: dict[str, Any]) -> bool:
    """quant_method fp8, or compressed-tensors' float-quantized (models/config/ct_fp8.py)."""
    quant = hf.get("quantization_config")
    return isinstance(quant, dict) and (quant.get("quant_method") == "fp8" or (
        quant.get("quant_method") == "compressed-tensors" and quant.get("format") == "float-quantized"))


def fp8_fields(quant: dict[str, Any]) -> dict[str, Any]:
    """weight_dtype fp8_block (auto where the file asks dequantize), weight_fp8, weight_block_size."""
    if quant.get("quant_method") == "compressed-tensors":
        from jaxfill.models.config.ct_fp8 import ct_fp8_fields

        return ct_fp8_fields(quant)
    for key, value in quant.items():
        if key in FIXED and value not in FIXED[key]:
            raise ConfigError(f"config.json quantization_config.{key}={value!r} is not supported "
                              f"(fp8 block-scaled checkpoints: {FIXED[key][0]!r})")
        if key not in FIXED and key not in READ:
            raise ConfigError(f"config.json quantization_config.{key} (= {value!r}) is not understood for "
                              "quant_method fp8; jaxfill refuses what it cannot reproduce")
    block = quant.get("weight_block_size")
    if not isinstance(block, (list, tuple)) or len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ConfigError(f"config.json quantization_config.weight_block_size={block!r} is not supported "
                          "(two positive sizes: per-tensor scales are not)")
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ConfigError(f"config.json quantization_config.activation_scheme={scheme!r} is not supported "
                          "(dynamic or static)")
    fmt = quant.get("fmt", "e4m3")
    if fmt not in FMT:
        raise ConfigError(f"config.json quantization_config.fmt={fmt!r} is not supported (one of {sorted(FMT)})")
    return dict(weight_dtype="auto" if quant.get("dequantize") else "fp8_block", weight_fp8=FMT[fmt],
                weight_block_size=tuple(block))
