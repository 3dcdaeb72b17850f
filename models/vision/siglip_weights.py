"""Fill a SiglipEncoder (models/vision/siglip.py) from a Gemma3ForConditionalGeneration
checkpoint: `vision_tower.vision_model.*` (or without `vision_model.`,
with or without a leading `model.`) and `model.multi_modal_projector.*`. torch Linear weights are [out, in], kept
[in, out]; the patch Conv2d kernel [E, C, P, P] (stride = kernel) becomes [C*P*P, E]; the
projector's weight is already [vision E, text E]."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxfill.models.safetensors_file import CheckpointError, TensorSlices, read_safetensors, safetensors_files
from jaxfill.models.vision.siglip import SiglipConfig, SiglipEncoder

# longest first: hub checkpoints write `vision_tower.vision_model.`, transformers 5's save_pretrained `vision_tower.`
TOWER = ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_tower.", "vision_tower.")
PROJECTOR = ("model.multi_modal_projector.", "multi_modal_projector.")


def _set(param, value):
    param.set_value(jnp.asarray(value, param.dtype))


def _linear(layer, t, name):
    _set(layer.w, t[name + ".weight"].T)
    _set(layer.b, t[name + ".bias"])


def _norm(layer, t, name):
    _set(layer.scale, t[name + ".weight"])
    _set(layer.bias, t[name + ".bias"])


def fill(enc: SiglipEncoder, t: dict[str, np.ndarray]) -> SiglipEncoder:
    """`t`: the tower's tensors under `vision/` and the projector's under `projector/`."""
    cfg: SiglipConfig = enc.cfg
    kernel = t["vision/embeddings.patch_embedding.weight"]
    if kernel.shape != (cfg.hidden_size, cfg.in_channels, cfg.patch_size, cfg.patch_size):
        raise CheckpointError(f"patch kernel {kernel.shape} does not match the vision config {cfg}")
    _set(enc.patch.w, kernel.reshape(cfg.hidden_size, -1).T)
    _set(enc.patch.b, t["vision/embeddings.patch_embedding.bias"])
    _set(enc.pos_table, t["vision/embeddings.position_embedding.weight"])
    for i, layer in enumerate(enc.layers):
        p = f"vision/encoder.layers.{i}."
        _norm(layer.norm1, t, p + "layer_norm1")
        _norm(layer.norm2, t, p + "layer_norm2")
        for mine, theirs in ((layer.q, "q_proj"), (layer.k, "k_proj"), (layer.v, "v_proj"), (layer.o, "out_proj")):
            _linear(mine, t, p + "self_attn." + theirs)
        _linear(layer.fc1, t, p + "mlp.fc1")
        _linear(layer.fc2, t, p + "mlp.fc2")
    _norm(enc.post_norm, t, "vision/post_layernorm")
    _set(enc.mm_norm, t["projector/mm_soft_emb_norm.weight"])
    _set(enc.mm_proj, t["projector/mm_input_projection_weight"])
    return enc


def tower_tensors(model_dir: str) -> dict[str, np.ndarray]:
    """The tower's and projector's tensors, f32 numpy, named `vision/...` and `projector/...`."""
    out = {}
    for path in safetensors_files(model_dir):
        for name, stored in read_safetensors(path):
            for group, prefixes in (("vision/", TOWER), ("projector/", PROJECTOR)):
                for prefix in prefixes:
                    if name.startswith(prefix):
                        tensor = TensorSlices(stored, stored.shape, tuple(range(len(stored.shape))), np.dtype(np.float32))
                        out[group + name[len(prefix):]] = tensor.read()
                        break
    if not any(k.startswith("projector/") for k in out) or not any(k.startswith("vision/") for k in out):
        raise CheckpointError(f"{model_dir} holds no Gemma 3 vision tower and projector "
                              "(model.vision_tower.vision_model.*, model.multi_modal_projector.*)")
    return out


def load_siglip(model_dir: str, cfg: SiglipConfig) -> SiglipEncoder:
    return fill(SiglipEncoder(cfg, nnx.Rngs(0)), tower_tensors(model_dir))
