"""FP8 block-scaled checkpoints (models/fp8_block.py): loaded with model.weight_dtype =
fp8_block (what their quantization_config chooses), the projections stay float8 on the
device with their block scales, and the f32 logits and greedy tokens are HF's on the
checkpoint's dequantized values (tests/fp8_checkpoints.py writes both). Blocks of 48 x 24
cut every projection of the test shapes (hidden 64, intermediate 160, ...) into partial
edge blocks, which transformers' own FP8 loader cannot load (its dequantize=True path
derives the block from the shapes); on 16 x 16 blocks that loader is the reference too."""

import json
import os
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Hugging Face reference and the writer need torch (the test extra)")
from flax import nnx
from safetensors.torch import load_file as load_torch, save_file

from fp8_checkpoints import write_fp8
from hf_models import load_hf, make_hf_checkpoint
from jaxfill.engine.config import load_config
from jaxfill.models.checkpoint import CheckpointError, load_hf_params
from jaxfill.models.config import ConfigError
from jaxfill.models.families.registry import config_from_hf
from jaxfill.models.fp8_block import LAYOUTS, scale_shape
from jaxfill.models.quant import scale_path
from jaxfill.engine.simple import generate_one
from test_model_parity import (PARITY_PAGES, STEP_ROWS, hf_last_logits, ours_last_logits, parity_cache, prompts,
                               rel_l2)

EDGE_BLOCK = (48, 24)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory):
    """arch, block, format -> an fp8 checkpoint (its dequantized twin at + "_ref"), made once."""
    root, made = tmp_path_factory.mktemp("fp8"), {}

    def make(arch: str, block: tuple = EDGE_BLOCK, fmt: str = "float8_e4m3fn") -> str:
        key = (arch, block, fmt)
        if key not in made:
            plain = str(root / f"{arch}_plain")
            if not os.path.exists(plain):
                make_hf_checkpoint(plain, arch)
            made[key] = write_fp8(plain, str(root / f"{arch}_{fmt}_{block[0]}x{block[1]}"), block, fmt)
        return made[key]
    return make


def kept_params(model) -> dict:
    return {p: v[...] for p, v in nnx.to_flat_state(nnx.state(model)) if p[-1] in LAYOUTS}


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "deepseek_v3"])
def test_fp8_checkpoint_matches_hf_on_its_dequantized_weights(fp8_dirs, arch):
    """Dense projections, a MoE's per-expert projections and shared experts, MLA's latent
    projections (q_a, q_b, kv_a_proj_with_mqa, kv_b_proj): float8 on the device, one
    [in / 24, out / 48] f32 scale grid beside each, HF-exact in f32."""
    directory = fp8_dirs(arch)
    config = config_from_hf(directory)
    assert (config.weight_dtype, config.weight_block_size, config.weight_fp8) == ("fp8_block", EDGE_BLOCK,
                                                                                   "float8_e4m3fn")
    model = load_hf_params(directory, config, progress=False)
    state = dict(nnx.to_flat_state(nnx.state(model)))
    kept = kept_params(model)
    assert len(kept) >= 7 * config.num_layers - 2
    for path, w in kept.items():
        scale = state[scale_path(path)][...]
        assert w.dtype == ml_dtypes.float8_e4m3fn and w.nbytes == w.size, path
        assert scale.dtype == np.float32 and scale.shape == scale_shape(w.shape, LAYOUTS[path[-1]], EDGE_BLOCK), path
    assert state[("embed", "embedding")][...].dtype == np.float32  # embeddings, norms, routers: as stored
    hf = load_hf(directory + "_ref")
    for n, tokens in prompts(config.vocab_size):
        ours, ref = ours_last_logits(model, config, tokens), hf_last_logits(hf, tokens)
        assert rel_l2(ours, ref) <= 1e-5, (arch, n, rel_l2(ours, ref))
    greedy_matches_hf(model, config, hf, prompts(config.vocab_size)[2][1], 8)


def greedy_matches_hf(model, config, hf, prompt, new_tokens: int) -> None:
    """Our greedy continuation of `prompt` is HF generate's, token for token (the 64-token
    prompt: the 20-token one of check_greedy_matches_hf repeats one token on Qwen3-MoE here)."""
    import torch

    with torch.no_grad():
        out = hf.generate(torch.tensor(prompt)[None], max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = out[0, len(prompt):].tolist()
    ours, _ = generate_one(model, list(prompt), parity_cache(config), new_tokens, pages=PARITY_PAGES,
                           step_rows=STEP_ROWS)
    assert ours == expected and len(set(expected)) > 1, (ours, expected)


def test_transformers_fp8_loader_reads_our_checkpoint_as_we_do(fp8_dirs):
    """On whole blocks (16 x 16) transformers loads the fp8 checkpoint itself (dequantized
    on CPU): its logits are the dequantized twin's, so the writer follows the published
    layout, and ours match it."""
    directory = fp8_dirs("llama", (16, 16))
    config = config_from_hf(directory)
    model = load_hf_params(directory, config, progress=False)
    theirs, twin = load_hf(directory), load_hf(directory + "_ref")
    tokens = prompts(config.vocab_size)[2][1]
    np.testing.assert_array_equal(hf_last_logits(theirs, tokens), hf_last_logits(twin, tokens))
    assert rel_l2(ours_last_logits(model, config, tokens), hf_last_logits(theirs, tokens)) <= 1e-5


@pytest.mark.parametrize("weight_dtype", ["auto", "int8"])
def test_dequantized_and_int8_loads_equal_the_dequantized_checkpoint(fp8_dirs, weight_dtype):
    """model.weight_dtype auto (or int8) on an fp8 checkpoint: the projections load as the
    dequantized values (re-quantized to int8 from them), box by box, bit for bit."""
    directory = fp8_dirs("qwen3_moe")
    config = config_from_hf(directory).replace(weight_dtype=weight_dtype)
    a = load_hf_params(directory, config, progress=False)
    b = load_hf_params(directory + "_ref", config, progress=False)
    for (path, x), (_, y) in zip(nnx.to_flat_state(nnx.state(a)), nnx.to_flat_state(nnx.state(b))):
        np.testing.assert_array_equal(np.asarray(x[...]), np.asarray(y[...]), err_msg=str(path))


def test_e5m2_checkpoint_stays_e5m2(fp8_dirs):
    directory = fp8_dirs("llama", fmt="float8_e5m2")
    with open(os.path.join(directory, "config.json")) as f:
        hf = json.load(f)
    hf["quantization_config"]["fmt"] = "e5m2"
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf, f)
    config = config_from_hf(directory)
    model = load_hf_params(directory, config, progress=False)
    assert {w.dtype for w in kept_params(model).values()} == {np.dtype(ml_dtypes.float8_e5m2)}
    tokens = prompts(config.vocab_size)[1][1]
    assert rel_l2(ours_last_logits(model, config, tokens), hf_last_logits(load_hf(directory + "_ref"), tokens)) <= 1e-5
    with pytest.raises(CheckpointError, match="weight_fp8 = float8_e5m2"):  # kept as stored, never converted
        load_hf_params(directory, config.replace(weight_fp8="float8_e4m3fn"), progress=False)


def _with_quant(directory: str, tmp_path, quant: dict) -> str:
    bad = str(tmp_path / "bad")
    shutil.copytree(directory, bad)
    with open(os.path.join(bad, "config.json")) as f:
        hf = json.load(f)
    hf["quantization_config"] = quant
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump(hf, f)
    return bad


BAD_QUANT = {
    "unknown key": ({"quant_method": "fp8", "weight_block_size": [48, 24], "group_size": 64}, "group_size"),
    "ue8m0 scales": ({"quant_method": "fp8", "weight_block_size": [48, 24], "scale_fmt": "ue8m0"}, "scale_fmt"),
    "per-tensor": ({"quant_method": "fp8", "weight_block_size": None}, "weight_block_size"),
    "activations": ({"quant_method": "fp8", "weight_block_size": [48, 24], "activation_scheme": "mx"},
                    "activation_scheme"),
}


@pytest.mark.parametrize("case", sorted(BAD_QUANT))
def test_other_quantization_configs_are_refused_by_name(fp8_dirs, tmp_path, case):
    quant, key = BAD_QUANT[case]
    bad = _with_quant(fp8_dirs("llama"), tmp_path, quant)
    with pytest.raises(ConfigError, match=key) as e:
        config_from_hf(bad)
    assert "\n" not in str(e.value)


def test_cli_refuses_a_malformed_quantization_config_in_one_line(fp8_dirs, tmp_path):
    bad = _with_quant(fp8_dirs("llama"), tmp_path, BAD_QUANT["ue8m0 scales"][0])
    proc = subprocess.run([sys.executable, "-m", "jaxfill.serving.cli", "plan", "--model", bad], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("jaxfill: error:") and "scale_fmt" in lines[-1], lines


def test_a_split_that_cuts_a_block_is_refused_at_config_time(fp8_dirs):
    directory = fp8_dirs("llama")  # q's 64 outputs over tensor=2: 32 a device, inside a 48-row block
    with pytest.raises(ConfigError, match="mesh.tensor = 2.*fp8 block") as e:
        load_config("tiny", {"mesh.tensor": 2}, directory)
    assert "\n" not in str(e.value)
    load_config("tiny", {"mesh.tensor": 2, "model.weight_dtype": "auto"}, directory)  # dequantized: any split
    load_config("tiny", {"mesh.tensor": 2}, fp8_dirs("llama", (16, 16)))  # whole blocks a device


def test_fp8_block_on_an_unquantized_checkpoint_is_refused(fp8_dirs):
    with pytest.raises(ConfigError, match="fp8_block"):
        load_config("tiny", {"model.weight_dtype": "fp8_block"}, fp8_dirs("llama") + "_ref")


def test_missing_or_misshapen_scales_are_refused_by_name(fp8_dirs, tmp_path):
    from broken_checkpoints import assert_breaks_are_named

    name = "model.layers.1.mlp.down_proj.weight_scale_inv"
    assert_breaks_are_named(fp8_dirs("llama"), name, {"missing": lambda t: t.pop(name),
                                                      "shape": lambda t: t.update({name: t[name][:, :-1]})},
                            tmp_path, "layers.1.mlp.down_proj")


def test_planned_weight_bytes_of_deepseek_v3_in_fp8_are_half_of_bf16():
    """The planner counts the params as allocated: fp8 projections one byte a weight plus
    their f32 scales (1/16384 of a 128 x 128 block), embeddings and norms in bf16."""
    from jaxfill.engine.planner.counts import weight_bytes

    bf16 = load_config("deepseek_v3").model
    fp8 = load_config("deepseek_v3", {"model.weight_dtype": "fp8_block"}).model
    assert bf16.dtype == "bfloat16"
    assert 0.49 < weight_bytes(fp8) / weight_bytes(bf16) < 0.51, weight_bytes(fp8) / weight_bytes(bf16)


def test_scales_of_the_stored_tensors_are_the_params_scales(fp8_dirs):
    """The scale params hold the file's weight_scale_inv, transposed to [in / B1, out / B0]
    (experts stacked, gate and up apart)."""
    directory = fp8_dirs("qwen3_moe")
    stored = {k: v.numpy() for k, v in load_torch(os.path.join(directory, "model.safetensors")).items()
              if k.endswith("_scale_inv")}
    state = dict(nnx.to_flat_state(nnx.state(load_hf_params(directory, config_from_hf(directory), progress=False))))
    p = "model.layers.0."
    np.testing.assert_array_equal(state[("layers", 0, "attn", "o_scale")][...],
                                  stored[p + "self_attn.o_proj.weight_scale_inv"].T)
    gate_up = state[("layers", 0, "mlp", "experts_gate_up_scale")][...]  # [E, in / B1, 2, out / B0]
    np.testing.assert_array_equal(gate_up[3, :, 1], stored[p + "mlp.experts.3.up_proj.weight_scale_inv"].T)
