"""gpt-oss's MXFP4 experts: a checkpoint whose experts are `_blocks`/`_scales` loads to
exactly the values they encode, decoded here from the format's definition (E2M1 codes
and power-of-two scales), not with models/mxfp4.py's lookup table."""

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from hf_models import make_hf_checkpoint
from jaxfill.models.checkpoint import CheckpointError, load_hf_params
from jaxfill.models.config import ConfigError
from jaxfill.models.families.registry import config_from_hf
from test_model_parity import ours_last_logits, prompts


def e2m1(code):  # [...] uint8 in [0, 16) -> f64: sign, 2 exponent bits (bias 1), 1 mantissa bit
    sign = np.where(code & 8, -1.0, 1.0)
    exp, man = (code >> 1) & 3, code & 1
    magnitude = np.where(exp == 0, 0.5 * man, 2.0 ** (exp.astype(np.float64) - 1) * (1 + 0.5 * man))
    return sign * magnitude


def random_mxfp4(rng, e, n_in, n_out):
    """(blocks [E, out, in/32, 16], scales [E, out, in/32], the [E, in, out] values)."""
    codes = rng.integers(0, 16, (e, n_out, n_in), dtype=np.uint8)
    scales = rng.integers(121, 126, (e, n_out, n_in // 32), dtype=np.uint8)
    values = e2m1(codes) * 2.0 ** (np.repeat(scales, 32, axis=-1).astype(np.float64) - 127)
    pairs = codes.reshape(e, n_out, n_in // 32, 16, 2)  # input 2j in the low nibble, 2j + 1 in the high
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)
    return blocks, scales, values.transpose(0, 2, 1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The same gpt-oss model twice: experts as float tensors, and as MXFP4 blocks/scales."""
    root = tmp_path_factory.mktemp("mxfp4")
    plain = make_hf_checkpoint(str(root / "plain"), "gpt_oss")
    packed = str(root / "packed")
    shutil.copytree(plain, packed)
    tensors = load_file(os.path.join(plain, "model.safetensors"))
    rng = np.random.default_rng(0)
    packed_tensors = dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, n_in, n_out = tensors[name].shape
        blocks, scales, values = random_mxfp4(rng, e, n_in, n_out)
        tensors[name] = np.ascontiguousarray(values, np.float32)  # save_file writes the raw buffer
        del packed_tensors[name]
        packed_tensors[name + "_blocks"], packed_tensors[name + "_scales"] = blocks, scales
    save_file(tensors, os.path.join(plain, "model.safetensors"), metadata={"format": "pt"})
    save_file(packed_tensors, os.path.join(packed, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(packed, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    with open(os.path.join(packed, "config.json"), "w") as f:
        json.dump(config, f)
    return plain, packed


@pytest.mark.parametrize("weight_dtype", ["auto", "int8"])
def test_mxfp4_experts_load_to_the_values_they_encode(checkpoints, weight_dtype):
    plain, packed = checkpoints
    config = dataclasses.replace(config_from_hf(packed), weight_dtype=weight_dtype)
    assert config == dataclasses.replace(config_from_hf(plain), weight_dtype=weight_dtype)
    a, b = (load_hf_params(d, config, progress=False) for d in (plain, packed))
    for layer in range(config.num_layers):
        for name in ("experts_gate_up", "experts_down") + (("experts_gate_up_scale", "experts_down_scale")
                                                           if weight_dtype == "int8" else ()):
            want, got = (np.asarray(getattr(m.layers[layer].mlp, name)[...]) for m in (a, b))
            np.testing.assert_array_equal(got, want, err_msg=f"layer {layer} {name}")
    tokens = prompts(config.vocab_size)[0][1]
    np.testing.assert_array_equal(ours_last_logits(b, config, tokens), ours_last_logits(a, config, tokens))


def test_mxfp4_blocks_of_the_wrong_shape_or_without_scales_are_refused(checkpoints, tmp_path):
    _, packed = checkpoints
    tensors = load_file(os.path.join(packed, "model.safetensors"))
    name = "model.layers.0.mlp.experts.down_proj"
    for case, change in {"shape": lambda t: t.update({name + "_scales": t[name + "_scales"][:, :-1]}),
                         "missing": lambda t: t.pop(name + "_scales")}.items():
        bad = str(tmp_path / case)
        shutil.copytree(packed, bad)
        broken = dict(tensors)
        change(broken)
        save_file(broken, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match="down_proj"):
            load_hf_params(bad, config_from_hf(bad), progress=False)


def test_other_quantization_methods_are_refused(checkpoints, tmp_path):
    _, packed = checkpoints
    with open(os.path.join(packed, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "bitsandbytes"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="bitsandbytes"):
        config_from_hf(str(path))
