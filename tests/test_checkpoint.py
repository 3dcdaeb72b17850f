"""Checkpoint loading: sharded sets, dtype casts, clear errors; orbax round trip."""

import dataclasses
import os

import jax
import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="the Hugging Face reference needs torch (the test extra)")
from safetensors.torch import load_file, save_file

from hf_models import make_hf_checkpoint
from jaxfill.models.checkpoint import CheckpointError, load_hf_params, restore_params, save_params
from jaxfill.models.families.registry import config_from_hf


def leaves(model):
    from flax import nnx

    return jax.tree.leaves(nnx.state(model))


def test_sharded_checkpoint_and_bf16_cast(tmp_path):
    d = str(tmp_path / "sharded")
    make_hf_checkpoint(d, "llama", torch.bfloat16, num_hidden_layers=2)
    import transformers as tf

    tf.AutoModelForCausalLM.from_pretrained(d).save_pretrained(d, max_shard_size="50KB")
    assert os.path.exists(os.path.join(d, "model.safetensors.index.json"))
    config = config_from_hf(d)
    model = load_hf_params(d, config, progress=False)
    assert config.dtype == "bfloat16"
    assert {str(l.dtype) for l in leaves(model)} == {"bfloat16"}
    f32 = load_hf_params(d, dataclasses.replace(config, dtype="float32"), progress=False)
    assert {str(l.dtype) for l in leaves(f32)} == {"float32"}


def test_missing_mismatched_and_unexpected_tensors(hf_dirs, tmp_path):
    src = hf_dirs["llama"]
    config = config_from_hf(src)
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
    config = config_from_hf(hf_dirs["qwen2"])
    model = load_hf_params(hf_dirs["qwen2"], config, progress=False)
    save_params(model, str(tmp_path / "ckpt"))
    restored = restore_params(str(tmp_path / "ckpt"), config)
    for a, b in zip(leaves(model), leaves(restored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _write_one(path, name, array, dtype="F32", shape=None):
    """A safetensors file holding `array` between two NaN tensors."""
    import json

    nan = np.full(37, np.nan, np.float32).tobytes()
    data = array.tobytes()
    header = {"before": {"dtype": "F32", "shape": [37], "data_offsets": [0, len(nan)]},
              name: {"dtype": dtype, "shape": list(shape or array.shape),
                     "data_offsets": [len(nan), len(nan) + len(data)]},
              "after": {"dtype": "F32", "shape": [37], "data_offsets": [len(nan) + len(data), 2 * len(nan) + len(data)]}}
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob + nan + data + nan)


@pytest.mark.parametrize("box", [
    (slice(None), slice(2, 4), slice(None)),  # heads: a leading axis of the stored [H, D, E]
    (slice(8, 16), slice(None), slice(None)),  # embed: the stored inner axis
    (slice(3, 5), slice(1, 3), slice(2, 6)),  # a box in every axis
    (),  # the whole tensor
])
def test_tensor_slices_read_only_their_box(tmp_path, box):
    """q_proj [Hq*D, E] read as the param [E, Hq, D]: every box equals numpy's transpose of
    the whole tensor; elements outside the box are NaN in the file, so a read that strays
    (or misplaces an offset) shows up."""
    from jaxfill.models.checkpoint import StoredTensor, TensorSlices, read_safetensors

    hq, d, e = 4, 8, 16
    w = np.random.RandomState(0).standard_normal((hq * d, e)).astype(np.float32)  # HF layout
    param = w.reshape(hq, d, e).transpose(2, 0, 1)
    want = param[box]
    poisoned = np.full_like(param, np.nan)
    poisoned[box] = want
    stored_order = np.ascontiguousarray(poisoned.transpose(1, 2, 0)).reshape(hq * d, e)
    _write_one(tmp_path / "m.safetensors", "q", stored_order)
    stored = dict(read_safetensors(str(tmp_path / "m.safetensors")))["q"]
    assert isinstance(stored, StoredTensor) and stored.shape == (hq * d, e)
    tensor = TensorSlices(stored, (hq, d, e), (2, 0, 1), np.dtype(np.float32))
    assert tensor.shape == (e, hq, d)
    got = tensor.read(box)
    assert got.flags.c_contiguous and not np.isnan(got).any()
    np.testing.assert_array_equal(got, want)


def test_tensor_slices_cast_the_slice_and_reject_bad_input(tmp_path):
    import ml_dtypes

    from jaxfill.models.checkpoint import TensorSlices, read_safetensors

    w = np.random.RandomState(1).standard_normal((6, 10)).astype(ml_dtypes.bfloat16)
    _write_one(tmp_path / "b.safetensors", "w", w, dtype="BF16")
    stored = dict(read_safetensors(str(tmp_path / "b.safetensors")))["w"]
    tensor = TensorSlices(stored, (6, 10), (1, 0), np.dtype(np.float32))  # an MLP weight: [E, I]
    got = tensor.read((slice(4, 9), slice(None)))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, w.T[4:9].astype(np.float32))
    with pytest.raises(ValueError, match="step 1"):
        tensor.read((slice(0, 10, 2),))
    _write_one(tmp_path / "short.safetensors", "w", w[:5], dtype="BF16", shape=w.shape)
    with pytest.raises(CheckpointError, match="data_offsets"):
        list(read_safetensors(str(tmp_path / "short.safetensors")))


def test_deepseek_multi_token_prediction_layers_are_skipped(tmp_path, caplog):
    """DeepSeek V3 checkpoints carry their MTP layer after the last decoder layer
    (model.layers.61.* for 61 layers): skipped with one log line when config.json
    announces it (num_nextn_predict_layers), refused by name when it does not."""
    import json
    import logging

    model_dir = make_hf_checkpoint(str(tmp_path / "dsv3"), "deepseek_v3_dense")
    config = config_from_hf(model_dir)
    plain = leaves(load_hf_params(model_dir, config, progress=False))
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    n = config.num_layers
    tensors.update({f"model.layers.{n}.eh_proj.weight": torch.randn(config.hidden_size, 2 * config.hidden_size),
                    f"model.layers.{n}.enorm.weight": torch.randn(config.hidden_size)})
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(model_dir, "config.json")) as f:
        hf = json.load(f)
    for mtp in (0, 1):  # transformers writes 1, DeepSeek's default
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump({**hf, "num_nextn_predict_layers": mtp}, f)
        if not mtp:
            with pytest.raises(CheckpointError, match=f"model.layers.{n}."):
                load_hf_params(model_dir, config, progress=False)
    with caplog.at_level(logging.INFO):
        with_mtp = leaves(load_hf_params(model_dir, config_from_hf(model_dir), progress=False))
    assert [r for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(with_mtp) == len(plain)
    for a, b in zip(with_mtp, plain):
        np.testing.assert_array_equal(a, b)
