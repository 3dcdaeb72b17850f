"""Checkpoint loading: sharded sets, dtype casts, clear errors; orbax round trip."""

import dataclasses
import os

import jax
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_models import make_hf_checkpoint
from jaxfill.models import ModelConfig
from jaxfill.models.checkpoint import CheckpointError, load_hf_params, restore_params, save_params


def leaves(model):
    from flax import nnx

    return jax.tree.leaves(nnx.state(model))


def test_sharded_checkpoint_and_bf16_cast(tmp_path):
    d = str(tmp_path / "sharded")
    make_hf_checkpoint(d, "llama", torch.bfloat16, num_hidden_layers=2)
    import transformers as tf

    tf.AutoModelForCausalLM.from_pretrained(d).save_pretrained(d, max_shard_size="50KB")
    assert os.path.exists(os.path.join(d, "model.safetensors.index.json"))
    config = ModelConfig.from_hf(d)
    model = load_hf_params(d, config, progress=False)
    assert config.dtype == "bfloat16"
    assert {str(l.dtype) for l in leaves(model)} == {"bfloat16"}
    f32 = load_hf_params(d, dataclasses.replace(config, dtype="float32"), progress=False)
    assert {str(l.dtype) for l in leaves(f32)} == {"float32"}


def test_missing_mismatched_and_unexpected_tensors(hf_dirs, tmp_path):
    src = hf_dirs["llama"]
    config = ModelConfig.from_hf(src)
    tensors = load_file(os.path.join(src, "model.safetensors"))

    def write(name, t):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(open(os.path.join(src, "config.json")).read())
        save_file(t, str(d / "model.safetensors"))
        return str(d)

    missing = write("missing", {k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k})
    with pytest.raises(CheckpointError, match="missing 1 tensors.*layers.1.mlp.up_proj"):
        load_hf_params(missing, config, progress=False)
    wrong = dict(tensors)
    wrong["model.norm.weight"] = torch.ones(7)
    with pytest.raises(CheckpointError, match=r"model.norm.weight.*\(7,\).*\(64,\)"):
        load_hf_params(write("wrong", wrong), config, progress=False)
    extra = dict(tensors, **{"model.layers.9.self_attn.q_proj.weight": torch.ones(2, 2)})
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.9"):
        load_hf_params(write("extra", extra), config, progress=False)
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_hf_params(str(tmp_path), config, progress=False)


def test_orbax_round_trip(hf_dirs, tmp_path):
    config = ModelConfig.from_hf(hf_dirs["qwen2"])
    model = load_hf_params(hf_dirs["qwen2"], config, progress=False)
    save_params(model, str(tmp_path / "ckpt"))
    restored = restore_params(str(tmp_path / "ckpt"), config)
    for a, b in zip(leaves(model), leaves(restored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
