"""AWQ / GPTQ / compressed-tensors integer checkpoints (models/int_group.py): their
quantization_config chooses model.weight_dtype = int_group, the projections stay packed
on the device (uint8, two 4-bit codes a byte, f32 group scales and zero points beside,
g_idx for GPTQ's act order), and the f32 logits and greedy tokens are HF's on the
checkpoint's dequantized values (tests/int_checkpoints.py writes both). A Llama of
hidden 128 / intermediate 256 lets groups of 32, 64 and 128 each cut the inputs whole.
The GPTQ and AWQ layouts here; compressed-tensors in tests/test_int_group_ct.py."""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Hugging Face reference and the writer need torch (the test extra)")
from flax import nnx

from hf_models import load_hf, make_hf_checkpoint
from int_checkpoints import FORMATS, write_int
from jaxfill.engine.config import load_config
from jaxfill.engine.simple import generate_one
from jaxfill.models.checkpoint import load_hf_params
from jaxfill.models.config import ConfigError
from jaxfill.models.families.registry import config_from_hf
from jaxfill.models.int_group import INPUT_AXES, STACKED, packed_shape, scale_shape
from test_model_parity import PARITY_PAGES, STEP_ROWS, hf_last_logits, ours_last_logits, parity_cache, prompts, rel_l2

SHAPE = dict(hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def int_dirs(tmp_path_factory):
    """format name (and arch) -> its checkpoint (the dequantized twin at + "_ref"), made once."""
    root, made = tmp_path_factory.mktemp("int"), {}

    def make(name: str, arch: str = "llama") -> str:
        plain = str(root / f"plain_{arch}")
        if not os.path.exists(plain):
            make_hf_checkpoint(plain, arch, **(SHAPE if arch == "llama" else {}))
        if (name, arch) not in made:
            made[name, arch] = write_int(plain, str(root / f"{arch}_{name}"), name)
        return made[name, arch]
    return make


def packed_params(model) -> dict:
    return {p: v[...] for p, v in nnx.to_flat_state(nnx.state(model)) if p[-1] in INPUT_AXES and v.dtype == np.uint8}


def projections(config) -> int:
    """The params a checkpoint's quantized projections fill: 7 a dense layer, a MoE layer's
    attention 4 + stacked experts 2 (+ 3 of its shared expert)."""
    moe = 0 if not config.moe.num_experts else config.num_layers - len(config.moe.dense_layers)
    if config.weight_int_scope == "experts":  # the routed experts alone (Kimi K2-Thinking)
        return 2 * moe
    return 7 * (config.num_layers - moe) + (6 + 3 * bool(config.moe.shared_expert_size)) * moe


def check_int_checkpoint(directory: str, name: str) -> None:
    """Loaded packed with the file's bits and groups; last-row logits of two prompts within
    1e-5 of HF on the dequantized twin, 8 greedy tokens equal to HF generate's."""
    _, bits, group, zero_point, extra = FORMATS[name]
    config = config_from_hf(directory)
    assert (config.weight_dtype, config.weight_bits, config.weight_group_size, config.weight_zero_point,
            config.weight_act_order) == ("int_group", bits, group, zero_point, bool(extra.get("desc_act")))
    assert config.weight_int_scope == ("experts" if "ignore" in extra else "all")
    model = load_hf_params(directory, config, progress=False)
    state = dict(nnx.to_flat_state(nnx.state(model)))
    packed = packed_params(model)
    assert len(packed) == projections(config)
    for path, w in packed.items():
        num_in, stacked = INPUT_AXES[path[-1]], STACKED.get(path[-1], 0)
        scales = path[:-1] + (path[-1] + "_scale",)
        a = stacked + num_in - 1
        full = w.shape[:a] + (w.shape[a] * (8 // bits),) + w.shape[a + 1:]
        assert w.dtype == np.uint8 and w.shape == packed_shape(full, num_in, bits, stacked), path
        for part in ("scale", "zero") if zero_point else ("scale",):  # symmetric: no zeros stored
            a = state[scales + (part,)][...]
            assert a.dtype == np.float32 and a.shape == scale_shape(full, num_in, group, stacked), (path, part)
        assert (scales + ("zero",) in state) == zero_point
        assert (scales + ("g_idx",) in state) == config.weight_act_order
    hf = load_hf(directory + "_ref")
    for n, tokens in prompts(config.vocab_size)[1:3]:
        ours, ref = ours_last_logits(model, config, tokens), hf_last_logits(hf, tokens)
        assert rel_l2(ours, ref) <= 1e-5, (name, n, rel_l2(ours, ref))
    prompt = list(prompts(config.vocab_size)[2][1])
    with torch.no_grad():
        out = hf.generate(torch.tensor(prompt)[None], max_new_tokens=8, min_new_tokens=8, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    expected = out[0, len(prompt):].tolist()
    got, _ = generate_one(model, prompt, parity_cache(config), 8, pages=PARITY_PAGES, step_rows=STEP_ROWS)
    assert got == expected and len(set(expected)) > 1, (name, got, expected)


@pytest.mark.parametrize("name", ["gptq", "gptq_act_order", "gptq_v2_8bit", "awq"])
def test_int_checkpoint_matches_hf_on_its_dequantized_weights(int_dirs, name):
    """GPTQ v1 (zeros stored minus one) asymmetric in groups of 32; desc_act with a
    permuted g_idx (symmetric); v2 8-bit in groups of 64; AWQ GEMM's interleaved nibbles
    in groups of 64."""
    check_int_checkpoint(int_dirs(name), name)


def test_fused_projections_split_by_rows(int_dirs):
    """Phi-3's fused qkv_proj and gate_up_proj, GPTQ act order: each part's rows cut from
    the unpacked codes, scales and zeros, the permuted g_idx shared by them."""
    check_int_checkpoint(int_dirs("gptq_act_order", "phi3"), "gptq_act_order")


def test_auto_and_int8_on_an_int_checkpoint_load_its_dequantized_values(int_dirs):
    """model.weight_dtype auto (or int8) on a GPTQ act-order checkpoint: every param is the
    dequantized twin's, bit for bit (int8: re-quantized from those values)."""
    directory = int_dirs("gptq_act_order")
    for weight_dtype in ("auto", "int8"):
        config = config_from_hf(directory).replace(weight_dtype=weight_dtype)
        a = load_hf_params(directory, config, progress=False)
        b = load_hf_params(directory + "_ref", config, progress=False)
        for (path, x), (_, y) in zip(nnx.to_flat_state(nnx.state(a)), nnx.to_flat_state(nnx.state(b))):
            np.testing.assert_array_equal(np.asarray(x[...]), np.asarray(y[...]), err_msg=f"{weight_dtype} {path}")


BASE = {"engine.num_pages": 8, "engine.max_model_len": 64}


def test_engine_config_refusals_name_the_key(int_dirs):
    """int_group on a float checkpoint, a group size other than the file's, and a tensor
    split that cuts a group (o's 128 inputs over 2 devices, groups of 128): one line each."""
    plain = os.path.join(os.path.dirname(int_dirs("gptq")), "plain_llama")
    cases = [(plain, {"model.weight_dtype": "int_group"}, "not one"),
             (int_dirs("gptq"), {"model.weight_group_size": 64}, "weight_group_size"),
             (int_dirs("gptq"), {"model.weight_dtype": "fp8_block"}, "fp8_block")]
    for directory, overrides, match in cases:
        with pytest.raises(ConfigError, match=match) as e:
            load_config("tiny", {**BASE, **overrides}, directory)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"mesh.tensor = 2.*cuts a quantization group \(o \[4, 32, 128\]") as e:
        load_config("tiny", {**BASE, "mesh.tensor": 2}, int_dirs("awq_128"))  # groups of 128
    load_config("tiny", {**BASE, "mesh.tensor": 2}, int_dirs("gptq"))  # groups of 32: whole on each device


BAD = {
    "3 bits": ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits=3"),
    "gptq unknown key": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "zero_shift": 1}, "zero_shift"),
    "gptq marlin packing": ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format"),
    "awq gemv": ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version"),
    "awq 8 bits": ({"quant_method": "awq", "bits": 8, "group_size": 128, "version": "gemm"}, "bits=8"),
    "unconverted modules": ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm",
                             "modules_to_not_convert": ["lm_head", "mlp.down_proj"]}, "modules_to_not_convert"),
    "odd group": ({"quant_method": "gptq", "bits": 4, "group_size": 33}, "group_size=33"),
    "gptq per-module overrides": ({"quant_method": "gptq", "bits": 4, "group_size": 128,
                                   "dynamic": {"-:.*down_proj": {}}}, "dynamic"),
}


def _ct(weights: dict, **top) -> dict:
    group = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                                "group_size": 32, "dynamic": False, **weights}}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": group},
            "ignore": ["lm_head"], "quantization_status": "compressed", **top}


BAD.update({
    "ct fp8 weights": (_ct({"type": "float", "num_bits": 8}, format="float-quantized"), "format"),
    "ct float type": (_ct({"type": "float"}), "type"),
    "ct ignored attention (Kimi K2)": (_ct({}, ignore=["lm_head", "re:.*self_attn.*"]), "ignore"),
    "ct act order g_idx": (_ct({"actorder": "group"}), "actorder"),
    "ct tensor strategy": (_ct({"strategy": "tensor"}), "strategy"),
    "ct two groups": (_ct({}, config_groups={"a": {}, "b": {}}), "config_groups"),
    "ct frozen": (_ct({}, quantization_status="frozen"), "quantization_status"),
})


def test_published_quantization_configs_read():
    """As AutoGPTQ, GPTQModel, AutoAWQ and Kimi K2-Thinking write them."""
    from jaxfill.models.config.int_quantization import int_fields

    auto_gptq = {"bits": 4, "damp_percent": 0.01, "desc_act": True, "group_size": 128, "is_marlin_format": False,
                 "model_file_base_name": None, "model_name_or_path": None, "quant_method": "gptq",
                 "static_groups": False, "sym": True, "true_sequential": True}
    gptq_model = {"bits": 8, "checkpoint_format": "gptq_v2", "damp_auto_increment": 0.0025, "damp_percent": 0.01,
                  "desc_act": False, "dynamic": None, "group_size": 64, "lm_head": False, "meta": {"quantizer": []},
                  "pack_dtype": "int32", "quant_method": "gptq", "static_groups": False, "sym": False,
                  "true_sequential": True}
    auto_awq = {"bits": 4, "group_size": 32, "modules_to_not_convert": None, "quant_method": "awq",
                "version": "gemm", "zero_point": True}
    kimi = _ct({"actorder": None, "observer": "minmax", "observer_kwargs": {}, "block_structure": None},
               ignore=["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                       "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"], kv_cache_scheme=None)
    got = [tuple(int_fields(q)[k] for k in ("weight_bits", "weight_group_size", "weight_zero_point",
                                             "weight_act_order")) for q in (auto_gptq, gptq_model, auto_awq, kimi)]
    assert got == [(4, 128, False, True), (8, 64, True, False), (4, 32, True, False), (4, 32, False, False)]
    assert int_fields(kimi)["weight_int_scope"] == "experts" and "weight_int_scope" not in int_fields(auto_awq)


@pytest.mark.parametrize("case", sorted(BAD))
def test_other_quantization_configs_are_refused_by_name(case):
    from jaxfill.models.config.int_quantization import int_fields

    quant, key = BAD[case]
    with pytest.raises(ConfigError, match=key) as e:
        int_fields(quant)
    assert "\n" not in str(e.value)


def test_missing_or_misshapen_int_tensors_are_refused_by_name(int_dirs, tmp_path):
    from broken_checkpoints import assert_breaks_are_named

    name = "model.layers.1.mlp.down_proj.qzeros"
    assert_breaks_are_named(int_dirs("awq"), name, {"missing": lambda t: t.pop(name),
                                                    "shape": lambda t: t.update({name: t[name][:-1]})},
                            tmp_path, "layers.1.mlp.down_proj")


def test_engine_stats_and_planner_report_the_packed_bytes(int_dirs):
    """4-bit codes are half a byte a weight, plus an f32 scale per 32-input group (symmetric:
    no zeros) and an int32 g_idx per input: what stats() and the planner count, against f32."""
    import dataclasses

    import jax

    from jaxfill.engine.engine import Engine
    from jaxfill.engine.planner.counts import weight_bytes
    from jaxfill.models.quant import param_bytes

    base = {"engine.num_pages": 8, "engine.max_model_len": 64, "engine.max_num_batched_tokens": 16,
            "engine.token_buckets": [16], "engine.max_num_seqs": 1, "mesh.cpu_split": False}
    packed = Engine.from_config("tiny", model_path=int_dirs("gptq_act_order"), overrides=base, progress=False)
    c = packed.config.model
    got, want = packed.stats()["weight_bytes"], weight_bytes(dataclasses.replace(c, weight_dtype="auto"))
    assert c.weight_dtype == "int_group" and got == weight_bytes(c) == param_bytes(packed.runner.state)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    e, i = c.hidden_size, c.intermediate_size
    shapes = [(e, q), (e, kv), (e, kv), (q, e), (e, i), (e, i), (i, e)] * c.num_layers  # (in, out)
    assert want - got == sum(n * m * 4 - (n * m // 2 + 4 * (n // 32) * m + 4 * n) for n, m in shapes)
    assert np.dtype(np.uint8) in {leaf.dtype for leaf in jax.tree.leaves(packed.runner.state)}
