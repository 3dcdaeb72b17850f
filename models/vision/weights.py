"""Fill a VisionEncoder from a checkpoint's `model.visual.*` tensors (or a dict of arrays).

torch Linear weights are [out, in]; the tower keeps [in, out] so every projection is x @ w.
The Conv3d patch kernel [E, C, T, P, P] with stride = kernel is a matmul over the flattened
C*T*P*P patch: reshaped to [E, C*T*P*P] and transposed.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxfill.models.safetensors_file import (
    CheckpointError, TensorSlices, read_safetensors, safetensors_files,
)
from jaxfill.models.vision.config import VisionConfig
from jaxfill.models.vision.qwen3_vl import VisionEncoder

PREFIXES = ("model.visual.", "visual.", "")  # Qwen3VLForConditionalGeneration, Qwen3VLModel, the bare tower


def _linear(layer, tensors, name):
    layer.w.set_value(jnp.asarray(tensors[name + ".weight"].T, layer.w.dtype))
    layer.b.set_value(jnp.asarray(tensors[name + ".bias"], layer.b.dtype))


def _norm(layer, tensors, name):
    layer.scale.set_value(jnp.asarray(tensors[name + ".weight"], layer.scale.dtype))
    layer.bias.set_value(jnp.asarray(tensors[name + ".bias"], layer.bias.dtype))


def _merger(m, tensors, name):
    _norm(m.norm, tensors, name + ".norm")
    _linear(m.fc1, tensors, name + ".linear_fc1")
    _linear(m.fc2, tensors, name + ".linear_fc2")


def fill(encoder: VisionEncoder, tensors: dict[str, np.ndarray]) -> VisionEncoder:
    """`tensors`: the tower's tensors by their names under the prefix (patch_embed.proj.weight, ...)."""
    cfg = encoder.cfg
    kernel = tensors["patch_embed.proj.weight"]
    if kernel.shape != (cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size):
        raise CheckpointError(f"patch kernel {kernel.shape} does not match the vision config {cfg}")
    encoder.patch.w.set_value(jnp.asarray(kernel.reshape(cfg.hidden_size, -1).T, cfg.dtype))
    encoder.patch.b.set_value(jnp.asarray(tensors["patch_embed.proj.bias"], cfg.dtype))
    encoder.pos_table.set_value(jnp.asarray(tensors["pos_embed.weight"], cfg.dtype))
    for i, block in enumerate(encoder.blocks):
        p = f"blocks.{i}"
        _norm(block.norm1, tensors, p + ".norm1")
        _norm(block.norm2, tensors, p + ".norm2")
        _linear(block.qkv, tensors, p + ".attn.qkv")
        _linear(block.proj, tensors, p + ".attn.proj")
        _linear(block.fc1, tensors, p + ".mlp.linear_fc1")
        _linear(block.fc2, tensors, p + ".mlp.linear_fc2")
    _merger(encoder.merger, tensors, "merger")
    for j, m in enumerate(encoder.deepstack):
        _merger(m, tensors, f"deepstack_merger_list.{j}")
    return encoder


def tower_tensors(model_dir: str) -> dict[str, np.ndarray]:
    """The tower's tensors of a checkpoint directory, read as f32 numpy, names under the prefix."""
    out = {}
    for path in safetensors_files(model_dir):
        for name, stored in read_safetensors(path):
            for prefix in PREFIXES[:2]:
                if name.startswith(prefix):
                    tensor = TensorSlices(stored, stored.shape, tuple(range(len(stored.shape))), np.dtype(np.float32))
                    out[name[len(prefix):]] = tensor.read()
    if not out:
        raise CheckpointError(f"{model_dir} holds no vision tower (no model.visual.* tensors)")
    return out


def load_encoder(model_dir: str, cfg: VisionConfig) -> VisionEncoder:
    encoder = VisionEncoder(cfg, nnx.Rngs(0))
    return fill(encoder, tower_tensors(model_dir))
