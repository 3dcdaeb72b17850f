"""Qwen3-VL's vision_config as the encoder needs it, read from the checkpoint's config.json."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = ()
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    dtype: object = jnp.float32

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:  # one flattened patch: C x T x P x P
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def grid_side(self) -> int:  # the learned position table is a square grid_side x grid_side
        return int(self.num_position_embeddings ** 0.5)

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2


ACTS = ("gelu_pytorch_tanh", "gelu", "silu")


def vision_config(hf: dict, dtype=jnp.float32) -> VisionConfig:
    """From a Qwen3VL config.json (its vision_config) or a bare vision config dict."""
    v = hf.get("vision_config", hf)
    rope = v.get("rope_parameters") or {}
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ACTS:
        raise ValueError(f"vision hidden_act {act!r} is not one of {ACTS}")
    return VisionConfig(
        depth=v["depth"], hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
        num_heads=v["num_heads"], out_hidden_size=v["out_hidden_size"], patch_size=v.get("patch_size", 16),
        temporal_patch_size=v.get("temporal_patch_size", 2), spatial_merge_size=v.get("spatial_merge_size", 2),
        in_channels=v.get("in_channels", 3), num_position_embeddings=v.get("num_position_embeddings", 2304),
        deepstack_visual_indexes=tuple(v.get("deepstack_visual_indexes", ())), hidden_act=act,
        rope_theta=float(rope.get("rope_theta", 10000.0)), dtype=dtype)
