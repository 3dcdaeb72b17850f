"""config.json's `quantization_config` for integer group-quantized checkpoints -> the
ModelConfig fields that keep them packed (model.weight_dtype = int_group,
models/int_group.py), and the file layout models/int_group_reader.py reads:

* `quant_method: gptq` (AutoGPTQ / GPTQModel; `checkpoint_format` / `format` gptq or
  gptq_v2), 4 or 8 bits, desc_act false or true (g_idx);
* `quant_method: awq`, the GEMM layout (`version` / `format` gemm), 4 bits;
* `quant_method: compressed-tensors`, one config group of int weights, `pack-quantized`
  (W4A16, W8A16; Kimi K2-Thinking) or `int-quantized` (W8A8: run weight-only here, the
  activations unquantized), group or channel strategy.

Every key is read, known to change nothing we compute (calibration settings), or
refused by name; so is any value we cannot reproduce (3 bits, other AWQ layouts, fp8
weights, modules left unquantized other than the LM head)."""

from __future__ import annotations

import re
from typing import Any

from jaxfill.models.config.errors import ConfigError

METHODS = ("gptq", "awq", "compressed-tensors", "gguf")  # gguf: models/gguf/int_codes.py
# what a quantizer did to find the codes, not how the file stores them
CALIBRATION = {"tokenizer", "dataset", "damp_percent", "damp_auto_increment", "true_sequential", "static_groups",
               "use_cuda_fp16", "model_seqlen", "module_name_preceding_first_block", "batch_size", "pad_token_id",
               "use_exllama", "max_input_length", "exllama_config", "cache_block_outputs", "backend", "meta",
               "quantizer", "model_name_or_path", "model_file_base_name", "mse", "act_group_aware", "do_fuse",
               "fuse_max_seq_len", "modules_to_fuse", "hyb_act", "v2", "v2_alpha", "block_name_to_quantize"}
GPTQ_KEYS = {"quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format", "format",
             "modules_to_not_convert", "modules_in_block_to_quantize", "lm_head", "pack_dtype", "is_marlin_format",
             "dynamic"}
AWQ_KEYS = {"quant_method", "bits", "w_bit", "group_size", "q_group_size", "zero_point", "version", "format",
            "modules_to_not_convert", "desc_act", "sym", "checkpoint_format"}
CT_KEYS = {"quant_method", "config_groups", "format", "ignore", "quantization_status", "kv_cache_scheme",
           "global_compression_ratio", "sparsity_config", "transform_config", "version", "moe_sparsity_config"}
CT_WEIGHT_KEYS = {"num_bits", "type", "symmetric", "strategy", "group_size", "dynamic", "actorder", "observer",
                  "observer_kwargs", "block_structure", "scale_dtype", "zp_dtype"}


def is_int(hf: dict[str, Any]) -> bool:
    """Integer codes: compressed-tensors' float-quantized (fp8) is models/config/quantization.py's."""
    quant = hf.get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") in METHODS and quant.get("format") != "float-quantized"


def _refuse(key: str, value, why: str) -> ConfigError:
    return ConfigError(f"config.json quantization_config.{key}={value!r} is not supported ({why})")


def refuse_unreproduced_ct(quant: dict) -> None:
    """What either compressed-tensors format (int here, float in ct_fp8.py) cannot reproduce."""
    if quant.get("quantization_status", "compressed") != "compressed":
        raise _refuse("quantization_status", quant["quantization_status"], "compressed checkpoints")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config", "moe_sparsity_config"):
        if quant.get(key):
            raise _refuse(key, quant[key], "not reproduced")


def _known(quant: dict, keys: set, method: str) -> None:
    for key, value in quant.items():
        if key not in keys and key not in CALIBRATION:
            raise ConfigError(f"config.json quantization_config.{key} (= {value!r}) is not understood for "
                              f"quant_method {method}; jaxfill refuses what it cannot reproduce")


def _bits(key: str, value, allowed: tuple = (4, 8)) -> int:
    if value not in allowed:
        raise _refuse(key, value, f"{' or '.join(map(str, allowed))} bits")
    return int(value)


def _group(key: str, value) -> int:
    if value is None or value == -1 or value == 0:
        return -1
    if not isinstance(value, int) or value < 2 or value % 2:
        raise _refuse(key, value, "a positive even group size, or -1 for one group per output channel")
    return value


def _no_unconverted(key: str, value) -> None:
    """Modules a checkpoint leaves unquantized: only the LM head (never packed here)."""
    names = [] if value is None else list(value)
    if any(n not in ("lm_head", "re:.*lm_head", "re:lm_head") for n in names):
        raise _refuse(key, value, "modules left unquantized other than lm_head have no per-module fallback")


# module names of each kind a compressed-tensors `ignore` list may leave unquantized (layers 0,
# 1 and 5; experts 0 and 3): it must leave each kind whole or not at all
_KINDS = {
    "attention": [f"self_attn.{x}" for x in ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj",
                                             "kv_a_proj_with_mqa", "kv_b_proj")],
    "dense MLP": [f"mlp.{x}" for x in ("gate_proj", "up_proj", "down_proj")],
    # two spellings (DeepSeek's, Qwen2-MoE's): a list need only name the model's; the loader
    # refuses a packed tensor where the model keeps one unquantized
    "shared experts": [f"mlp.shared_experts.{x}" for x in ("gate_proj", "up_proj", "down_proj")],
    "shared expert": [f"mlp.shared_expert.{x}" for x in ("gate_proj", "up_proj", "down_proj")],
    "experts": [f"mlp.experts.{j}.{x}" for j in (0, 3) for x in ("gate_proj", "up_proj", "down_proj")],
}


def _ignored(name: str, patterns: list) -> bool:  # compressed-tensors' match: "re:" a regex from the start, else the name
    return any(re.match(p[3:], name) if p.startswith("re:") else p == name for p in patterns)


def _scope(ignore) -> str:
    """weight_int_scope from an `ignore` list: nothing but the LM head ("all"), or the
    attention, dense MLPs and shared experts whole with the routed experts kept ("experts",
    Kimi K2-Thinking's). Anything between has no per-module fallback here."""
    patterns = [] if ignore is None else list(ignore)
    left = {}
    for kind, names in _KINDS.items():
        hits = [_ignored(f"model.layers.{i}.{n}", patterns) for i in (0, 1, 5) for n in names]
        left[kind] = "all" if all(hits) else "none" if not any(hits) else "some"
    if all(v == "none" for v in left.values()):
        return "all"
    if (left["attention"], left["dense MLP"], left["experts"]) == ("all", "all", "none") and "some" not in (
            left["shared experts"], left["shared expert"]):
        return "experts"
    raise _refuse("ignore", ignore, f"it leaves {', '.join(f'{v} {k}' for k, v in left.items())} unquantized; "
                  "kept packed: every projection, or the routed experts alone")


def int_fields(quant: dict[str, Any]) -> dict[str, Any]:
    """weight_dtype int_group with its bits, group size, zero points and act order."""
    method = quant.get("quant_method")
    if method == "gptq":
        _known(quant, GPTQ_KEYS, method)
        fmt = str(quant.get("checkpoint_format") or quant.get("format") or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise _refuse("checkpoint_format", fmt, "gptq or gptq_v2 packing")
        if quant.get("lm_head"):
            raise _refuse("lm_head", True, "a quantized LM head")
        if quant.get("is_marlin_format"):
            raise _refuse("is_marlin_format", True, "gptq or gptq_v2 packing")
        if quant.get("dynamic"):  # GPTQModel's per-module bits and groups
            raise _refuse("dynamic", quant["dynamic"], "one bit width and group size for every module")
        if quant.get("pack_dtype", "int32") != "int32":
            raise _refuse("pack_dtype", quant["pack_dtype"], "int32 words")
        if quant.get("modules_in_block_to_quantize") is not None:
            raise _refuse("modules_in_block_to_quantize", quant["modules_in_block_to_quantize"],
                          "every projection quantized")
        _no_unconverted("modules_to_not_convert", quant.get("modules_to_not_convert"))
        return dict(weight_dtype="int_group", weight_bits=_bits("bits", quant.get("bits")),
                    weight_group_size=_group("group_size", quant.get("group_size", 128)),
                    weight_zero_point=not quant.get("sym", True), weight_act_order=bool(quant.get("desc_act")))
    if method == "awq":
        _known(quant, AWQ_KEYS, method)
        version = str(quant.get("version") or quant.get("format") or "gemm").lower()
        if version != "gemm":
            raise _refuse("version", version, "the GEMM layout; gemv, exllama, marlin and ipex pack otherwise")
        if quant.get("zero_point", True) is not True:
            raise _refuse("zero_point", quant["zero_point"], "AWQ with zero points")
        if quant.get("desc_act"):
            raise _refuse("desc_act", True, "AWQ groups consecutive inputs")
        _no_unconverted("modules_to_not_convert", quant.get("modules_to_not_convert"))
        bits = quant.get("bits", quant.get("w_bit"))
        return dict(weight_dtype="int_group", weight_bits=_bits("bits", bits, (4,)),
                    weight_group_size=_group("group_size", quant.get("group_size", quant.get("q_group_size", 128))),
                    weight_zero_point=True, weight_act_order=False)
    if method == "gguf":  # a GGUF's quantized projections (models/gguf/int_codes.py)
        return _gguf(quant)
    return _compressed_tensors(quant)


def _gguf(quant: dict) -> dict:
    """Each projection in the form holding its layers' types; the most common form is the
    model's, the others are named in weight_int_forms."""
    from jaxfill.models.gguf.int_codes import FORMS, PROJECTIONS, common_form

    _known(quant, {"quant_method", "ggml_types"}, "gguf")
    types = quant.get("ggml_types")
    if not isinstance(types, dict) or not types:
        raise _refuse("ggml_types", types, "a mapping of projection to its GGUF types")
    forms = {}
    for name, kinds in types.items():
        listed = [k for k in str(kinds).split(",") if k]
        if name not in PROJECTIONS.values() or not listed or any(k not in FORMS for k in listed):
            raise _refuse(f"ggml_types.{name}", kinds, f"projections {', '.join(PROJECTIONS.values())} in "
                          f"{', '.join(FORMS)}")
        forms[name] = common_form(listed)
    values = list(forms.values())
    bits, group, zero_point = base = max(values, key=values.count)
    others = ",".join(f"{name}:{b}:{g}:{int(z)}" for name, (b, g, z) in forms.items() if (b, g, z) != base)
    return dict(weight_dtype="int_group", weight_bits=bits, weight_group_size=group, weight_zero_point=zero_point,
                weight_act_order=False, weight_int_forms=others)


def _compressed_tensors(quant: dict) -> dict:
    _known(quant, CT_KEYS, "compressed-tensors")
    fmt = quant.get("format")
    if fmt not in ("pack-quantized", "int-quantized"):
        raise _refuse("format", fmt, "pack-quantized or int-quantized; float-quantized (fp8) and others are not "
                      "kept as int_group")
    refuse_unreproduced_ct(quant)
    scope = _scope(quant.get("ignore"))
    groups = quant.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse("config_groups", sorted(groups), "exactly one group")
    name, group = next(iter(groups.items()))
    where = f"config_groups.{name}"
    targets = group.get("targets")
    if targets != ["Linear"]:
        raise _refuse(f"{where}.targets", targets, "['Linear']")
    if group.get("output_activations"):
        raise _refuse(f"{where}.output_activations", group["output_activations"], "not reproduced")
    act = group.get("input_activations")
    if act and (act.get("type") != "int" or not act.get("dynamic")):
        raise _refuse(f"{where}.input_activations", act, "dynamic int activations, run weight-only here")
    if group.get("format") not in (None, fmt):
        raise _refuse(f"{where}.format", group["format"], f"the checkpoint's format {fmt}")
    w = group.get("weights") or {}
    for key, value in w.items():
        if key not in CT_WEIGHT_KEYS:
            raise ConfigError(f"config.json quantization_config.{where}.weights.{key} (= {value!r}) is not "
                              "understood; jaxfill refuses what it cannot reproduce")
    if w.get("type") != "int":
        raise _refuse(f"{where}.weights.type", w.get("type"), "int weights (fp8 compressed-tensors is refused)")
    if w.get("dynamic") or w.get("block_structure"):
        raise _refuse(f"{where}.weights", w, "static group or channel scales")
    if w.get("actorder") not in (None, "static", "weight"):
        raise _refuse(f"{where}.weights.actorder", w["actorder"], "no g_idx (static or weight order)")
    strategy = w.get("strategy")
    if strategy not in ("group", "channel"):
        raise _refuse(f"{where}.weights.strategy", strategy, "group or channel")
    size = _group(f"{where}.weights.group_size", w.get("group_size")) if strategy == "group" else -1
    bits = _bits(f"{where}.weights.num_bits", w.get("num_bits"))
    if fmt == "int-quantized" and bits != 8:
        raise _refuse(f"{where}.weights.num_bits", bits, "int-quantized stores int8")
    return dict(weight_dtype="int_group", weight_bits=bits, weight_group_size=size,
                weight_zero_point=not w.get("symmetric", True), weight_act_order=False, weight_int_scope=scope)


def int_format_of(quant: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of models.int_group.IntGroupFormat the file's codes are in."""
    f = int_fields(quant)
    from jaxfill.models.int_group import parse_forms

    return dict(bits=f["weight_bits"], group=f["weight_group_size"], zero_point=f["weight_zero_point"],
                act_order=f["weight_act_order"], others=parse_forms(f.get("weight_int_forms", "")))


def file_format(quant: dict[str, Any]) -> tuple[str, bool]:
    """(models/int_group_reader.py's format name, GPTQ v1 zeros stored off by one)."""
    method = quant.get("quant_method")
    if method == "gptq":
        fmt = str(quant.get("checkpoint_format") or quant.get("format") or "gptq").lower()
        return "gptq", fmt == "gptq"
    if method in ("awq", "gguf"):
        return method, False
    return ("ct_pack" if quant.get("format") == "pack-quantized" else "ct_int"), False


def check_checkpoint(model, hf: dict[str, Any], path: str) -> None:
    """int_group keeps an int checkpoint's codes as stored: it needs one, with the bits and
    groups its quantization_config names (model.weight_dtype auto or int8 load its values
    dequantized instead)."""
    if not is_int(hf):
        if model.weight_dtype == "int_group":
            raise ConfigError(f"model.weight_dtype = 'int_group' keeps an AWQ / GPTQ / compressed-tensors "
                              f"checkpoint's codes as stored, and {path} is not one (no quantization_config "
                              "quant_method gptq, awq or compressed-tensors, nor a GGUF whose projections are all "
                              "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K): use auto or int8")
        return
    if model.weight_dtype == "int_group":
        for key, value in int_fields(hf["quantization_config"]).items():
            if getattr(model, key) != value:
                raise ConfigError(f"model.{key} = {getattr(model, key)!r}, but {path}'s quantization_config "
                                  f"stores {value!r}: int_group keeps the codes as stored")
