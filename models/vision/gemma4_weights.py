"""Fill a Gemma4VisionEncoder (models/vision/gemma4_vision.py) from a
Gemma4ForConditionalGeneration checkpoint: `model.vision_tower.*` and `model.embed_vision.*`
(with or without the leading `model.`). torch Linear weights are [out, in], kept [in, out];
a clipped linear's bounds are its input_min/max and output_min/max buffers."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxfill.models.safetensors_file import CheckpointError, TensorSlices, read_safetensors, safetensors_files
from jaxfill.models.vision.gemma4_vision import Gemma4VisionConfig, Gemma4VisionEncoder

TOWER = ("model.vision_tower.", "vision_tower.")
EMBEDDER = ("model.embed_vision.", "embed_vision.")
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def _set(param, value):
    if tuple(param.shape) != tuple(np.shape(value)):
        raise CheckpointError(f"vision tensor of shape {np.shape(value)} where the config needs {tuple(param.shape)}")
    param.set_value(jnp.asarray(value, param.dtype))


def _linear(layer, t, name):
    _set(layer.w, t[name + ".linear.weight"].T)
    if layer.clipped:
        _set(layer.bounds, np.asarray([t[f"{name}.{b}"] for b in ("input_min", "input_max", "output_min",
                                                                  "output_max")], np.float32).reshape(4))


def fill(enc: Gemma4VisionEncoder, t: dict[str, np.ndarray]) -> Gemma4VisionEncoder:
    """`t`: the tower's tensors under `vision/`, the embedder's under `embed/`."""
    cfg: Gemma4VisionConfig = enc.cfg
    _set(enc.patch, t["vision/patch_embedder.input_proj.weight"].T)
    _set(enc.pos_table, t["vision/patch_embedder.position_embedding_table"])
    for i, layer in enumerate(enc.layers):
        p = f"vision/encoder.layers.{i}."
        for norm, name in zip(layer.norms, NORMS):
            _set(norm.w, t[p + name + ".weight"])
        for mine, theirs in ((layer.q, "q_proj"), (layer.k, "k_proj"), (layer.v, "v_proj"), (layer.o, "o_proj")):
            _linear(mine, t, p + "self_attn." + theirs)
        _set(layer.q_norm.w, t[p + "self_attn.q_norm.weight"])
        _set(layer.k_norm.w, t[p + "self_attn.k_norm.weight"])
        for mine, theirs in ((layer.gate, "gate_proj"), (layer.up, "up_proj"), (layer.down, "down_proj")):
            _linear(mine, t, p + "mlp." + theirs)
    if cfg.standardize:
        _set(enc.std_bias, t["vision/std_bias"])
        _set(enc.std_scale, t["vision/std_scale"])
    _set(enc.proj, t["embed/embedding_projection.weight"].T)
    return enc


def tower_tensors(model_dir: str) -> dict[str, np.ndarray]:
    """The tower's and embedder's tensors, f32 numpy, named `vision/...` and `embed/...`."""
    out = {}
    for path in safetensors_files(model_dir):
        for name, stored in read_safetensors(path):
            for group, prefixes in (("vision/", TOWER), ("embed/", EMBEDDER)):
                prefix = next((p for p in prefixes if name.startswith(p)), None)
                if prefix is not None:
                    tensor = TensorSlices(stored, stored.shape, tuple(range(len(stored.shape))), np.dtype(np.float32))
                    out[group + name[len(prefix):]] = tensor.read()
                    break
    if not any(k.startswith("embed/") for k in out) or not any(k.startswith("vision/") for k in out):
        raise CheckpointError(f"{model_dir} holds no Gemma 4 vision tower and embedder "
                              "(model.vision_tower.*, model.embed_vision.*)")
    return out


def load_gemma4_vision(model_dir: str, cfg: Gemma4VisionConfig) -> Gemma4VisionEncoder:
    t = tower_tensors(model_dir)
    missing = [k for k in ("vision/patch_embedder.input_proj.weight", "embed/embedding_projection.weight") if k not in t]
    if missing:
        raise CheckpointError(f"{model_dir}: the Gemma 4 vision checkpoint lacks {missing}")
    try:
        return fill(Gemma4VisionEncoder(cfg, nnx.Rngs(0)), t)
    except KeyError as e:
        raise CheckpointError(f"{model_dir}: the Gemma 4 vision checkpoint lacks {e.args[0]}") from None
