"""compressed-tensors' fp8 W8A8 checkpoints (`format: float-quantized`: llm-compressor's
FP8_DYNAMIC per channel, FP8 per tensor, FP8_BLOCK), written by the compressed-tensors
library (tests/fp8_checkpoints.py write_ct_fp8), kept in fp8 on the device with their
scales (models/config/ct_fp8.py -> models/fp8_block.py, a block side of 0 spanning the
axis) and run weight-only. References: transformers' own compressed-tensors loader
(`dequantize=True`) on f32 scales, where it is exact; on bf16 scales it dequantizes in bf16,
so there HF runs the library's f32 decompression of the same file."""

import os

import ml_dtypes
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch", reason="the Hugging Face reference needs torch (the test extra)")
pytest.importorskip("compressed_tensors", reason="the writer is compressed-tensors itself (the test extra)")
from family_layouts import LAYOUTS, check_layouts, run_layouts
from fp8_checkpoints import write_ct_fp8
from hf_models import make_hf_checkpoint
from jaxfill.engine.config import load_config
from jaxfill.models.checkpoint import load_hf_params
from jaxfill.models.config import ConfigError
from jaxfill.models.config.ct_fp8 import ct_fp8_fields
from jaxfill.models.families.registry import config_from_hf
from jaxfill.models.fp8_block import LAYOUTS as FP8_LAYOUTS
from jaxfill.models.quant import scale_path
from test_model_parity import check_greedy_matches_hf, hf_last_logits, ours_last_logits, prompts, rel_l2

CASES = {"channel_f32": ("channel", None, torch.float32, (1, 0)), "tensor": ("tensor", None, torch.bfloat16, (0, 0)),
         "block": ("block", (32, 64), torch.bfloat16, (32, 64))}


@pytest.fixture(scope="module")
def ct_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ct_fp8")
    plain = str(root / "plain")
    make_hf_checkpoint(plain, "llama")
    return {name: write_ct_fp8(plain, str(root / name), strategy, block, dtype)
            for name, (strategy, block, dtype, _) in CASES.items()}


def hf_model(directory: str, own_loader: bool):
    import transformers as tf

    if own_loader:  # transformers' compressed-tensors path, dequantized to f32 (it runs no fp8 on CPU)
        return tf.AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32, quantization_config=tf.CompressedTensorsConfig(dequantize=True)).eval()
    return tf.AutoModelForCausalLM.from_pretrained(directory + "_ref", dtype=torch.float32).eval()


@pytest.mark.parametrize("name", sorted(CASES))
def test_ct_fp8_kept_in_fp8_matches_the_reference(ct_dirs, name):
    config = config_from_hf(ct_dirs[name]).replace(dtype="float32")
    assert (config.weight_dtype, config.weight_fp8, config.weight_block_size) == (
        "fp8_block", "float8_e4m3fn", CASES[name][3])
    model = load_hf_params(ct_dirs[name], config, progress=False)
    state = dict(nnx.to_flat_state(nnx.state(model)))
    kept = {p: v[...] for p, v in state.items() if p[-1] in FP8_LAYOUTS}
    assert len(kept) == 7 * config.num_layers
    for path, w in kept.items():
        assert w.dtype == ml_dtypes.float8_e4m3fn and w.nbytes == w.size, path
        scale = state[scale_path(path)][...]
        assert scale.dtype == np.float32 and scale.size < w.size / 8, path
    down = state[("layers", 0, "mlp", "down_scale")][...]
    assert down.shape == {"channel_f32": (1, config.hidden_size), "tensor": (1, 1),
                          "block": (-(-config.intermediate_size // 64), -(-config.hidden_size // 32))}[name]
    hf = hf_model(ct_dirs[name], own_loader=name == "channel_f32")
    for n, tokens in prompts(config.vocab_size)[:3]:
        assert rel_l2(ours_last_logits(model, config, tokens), hf_last_logits(hf, tokens)) <= 1e-5, (name, n)
    check_greedy_matches_hf(model, config, hf, 8)


@pytest.mark.slow
def test_ct_fp8_channel_scales_under_tensor2_equal_one_device(ct_dirs):
    """o and down split their inputs over two devices while each output row keeps one scale."""
    layouts = {name: {**LAYOUTS[name], "model.dtype": "float32"} for name in ("whole", "tensor2")}
    check_layouts(run_layouts(ct_dirs["channel_f32"], layouts, devices=2), "llama", ("tensor2",))


def test_malformed_ct_fp8_configs_are_refused_in_one_line(ct_dirs):
    import json

    with open(os.path.join(ct_dirs["tensor"], "config.json")) as f:
        good = json.load(f)["quantization_config"]
    weights = good["config_groups"]["group_0"]["weights"]
    bad = [({**good, "ignore": ["lm_head", "re:.*mlp.*"]}, "ignore"),
           ({**good, "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
           ({**good, "mystery": 1}, "mystery"),
           ({**good, "config_groups": {"group_0": {**good["config_groups"]["group_0"],
                                                   "weights": {**weights, "strategy": "group"}}}}, "strategy"),
           ({**good, "config_groups": {"group_0": {**good["config_groups"]["group_0"],
                                                   "weights": {**weights, "num_bits": 4}}}}, "weights"),
           ({**good, "config_groups": {"group_0": {**good["config_groups"]["group_0"],
                                                   "weights": {**weights, "strategy": "block",
                                                               "block_structure": [0, 64]}}}}, "block_structure")]
    for quant, field in bad:
        with pytest.raises(ConfigError, match=field) as e:
            ct_fp8_fields(quant)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="routed experts") as e:  # whole-axis scales on experts: not built
        load_config("tiny", {"model.architecture": "Qwen3MoeForCausalLM", "model.num_experts": 4,
                             "model.weight_dtype": "fp8_block", "model.weight_block_size": [1, 0]})
    assert "\n" not in str(e.value)
