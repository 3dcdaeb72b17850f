"""Qwen3-VL's vision tower: a ViT over flattened patches, its 2 x 2 patch merger, and the
DeepStack mergers that hand chosen layers' outputs to the first decoder layers.

All images of a call run as one flat row axis [N, ...]: attention is masked to each image's
own segment (full, not causal) instead of padding images to a common size, so one compiled
shape serves any mix of image sizes with the same total patch count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxfill.models.layers import next_key
from jaxfill.models.vision.attention import segment_attention
from jaxfill.models.vision.config import VisionConfig

EPS = 1e-6  # every LayerNorm in the tower
ACT = {"gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
       "gelu": lambda x: jax.nn.gelu(x, approximate=False), "silu": jax.nn.silu}
V = "vision"  # logical axis of every tower weight: replicated (models/sharding.py)


def _w(rngs: nnx.Rngs, shape, dtype, scale=0.02) -> nnx.Param:
    return nnx.Param((scale * jax.random.normal(next_key(rngs), shape, jnp.float32)).astype(dtype),
                     out_sharding=(V,) * len(shape), eager_sharding=False)


def _zeros(shape, dtype, value=0.0) -> nnx.Param:
    return nnx.Param(jnp.full(shape, value, dtype), out_sharding=(V,) * len(shape), eager_sharding=False)


class Linear(nnx.Module):
    def __init__(self, rngs, n_in: int, n_out: int, dtype):
        self.w, self.b = _w(rngs, (n_in, n_out), dtype), _zeros((n_out,), dtype)

    def __call__(self, x):  # [N, in] -> [N, out]
        return x @ self.w[...] + self.b[...]


class LayerNorm(nnx.Module):
    def __init__(self, n: int, dtype):
        self.scale, self.bias = _zeros((n,), dtype, 1.0), _zeros((n,), dtype)

    def __call__(self, x):  # [N, n]
        xf = x.astype(jnp.float32)
        mean = xf.mean(-1, keepdims=True)
        var = jnp.square(xf - mean).mean(-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + EPS)
        return (y * self.scale[...] + self.bias[...]).astype(x.dtype)


def rotate_half(x):  # [..., D]
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], -1)


def vision_rope(rows_cols: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin [N, D] of the 2D rotary: the first quarter of the frequencies turns with the
    patch row, the second with its column, and the half repeats (rotate-half layout), so the
    whole head dim rotates."""
    quarter = head_dim // 2
    inv = (1.0 / theta ** (np.arange(0, quarter, 2, dtype=np.float32) / quarter)).astype(np.float32)
    freqs = rows_cols.astype(jnp.float32)[:, :, None] * inv  # [N, 2, D/4]
    angles = jnp.concatenate([freqs[:, 0], freqs[:, 1]], -1)
    angles = jnp.concatenate([angles, angles], -1)
    return jnp.cos(angles), jnp.sin(angles)


class Block(nnx.Module):
    def __init__(self, cfg: VisionConfig, rngs):
        e, d = cfg.hidden_size, cfg.dtype
        self.norm1, self.norm2 = LayerNorm(e, d), LayerNorm(e, d)
        self.qkv, self.proj = Linear(rngs, e, 3 * e, d), Linear(rngs, e, e, d)
        self.fc1, self.fc2 = Linear(rngs, e, cfg.intermediate_size, d), Linear(rngs, cfg.intermediate_size, e, d)
        self.heads, self.act = cfg.num_heads, cfg.hidden_act

    def __call__(self, x, cos, sin, segments):  # x [N, E]; cos, sin [N, D]; segments [N] int32 (< 0: padding)
        n, e = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(n, 3, self.heads, e // self.heads)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]  # [N, H, D]
        c, s = cos[:, None].astype(jnp.float32), sin[:, None].astype(jnp.float32)
        q = (q.astype(jnp.float32) * c + rotate_half(q.astype(jnp.float32)) * s).astype(x.dtype)
        k = (k.astype(jnp.float32) * c + rotate_half(k.astype(jnp.float32)) * s).astype(x.dtype)
        attn = segment_attention(q, k, v, segments, (e // self.heads) ** -0.5).reshape(n, e)
        x = x + self.proj(attn)
        return x + self.fc2(ACT[self.act](self.fc1(self.norm2(x))))


class Merger(nnx.Module):
    """m*m consecutive patch rows (one merge block) -> one token of the decoder's width. The
    final merger norms each patch before folding; the DeepStack ones norm the folded row."""

    def __init__(self, cfg: VisionConfig, rngs, post_shuffle: bool):
        wide, d = cfg.hidden_size * cfg.merge_unit, cfg.dtype
        self.post_shuffle, self.wide = post_shuffle, wide
        self.norm = LayerNorm(wide if post_shuffle else cfg.hidden_size, d)
        self.fc1, self.fc2 = Linear(rngs, wide, wide, d), Linear(rngs, wide, cfg.out_hidden_size, d)

    def __call__(self, x):  # [N, E] -> [N / m^2, out]
        x = self.norm(x.reshape(-1, self.wide)) if self.post_shuffle else self.norm(x).reshape(-1, self.wide)
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=False))


class VisionEncoder(nnx.Module):
    def __init__(self, cfg: VisionConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        d = cfg.dtype
        self.patch = Linear(rngs, cfg.patch_dim, cfg.hidden_size, d)  # the Conv3d, kernel = stride
        self.pos_table = _w(rngs, (cfg.num_position_embeddings, cfg.hidden_size), d)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.depth)])
        self.merger = Merger(cfg, rngs, post_shuffle=False)
        self.deepstack = nnx.List([Merger(cfg, rngs, post_shuffle=True) for _ in cfg.deepstack_visual_indexes])

    def __call__(self,
                 pixels: jax.Array,  # [N, C*T*P*P] in merge-block order
                 rows_cols: jax.Array,  # [N, 2] int32
                 taps: jax.Array,  # [N, 4] int32
                 tap_weights: jax.Array,  # [N, 4] f32
                 segments: jax.Array,  # [N] int32: each row's image (frame); < 0: padding
                 ) -> tuple[jax.Array, jax.Array]:
        """(tokens [N/m^2, out], deepstack [L, N/m^2, out]): the image tokens in prompt
        order and, per DeepStack layer, what the decoder adds to them after its layer l."""
        cfg = self.cfg
        x = self.patch(pixels.astype(cfg.dtype))
        pos = (self.pos_table[...][taps] * tap_weights[:, :, None].astype(cfg.dtype)).sum(1)
        x = x + pos
        cos, sin = vision_rope(rows_cols, cfg.head_dim, cfg.rope_theta)
        stacked = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, segments)
            if i in cfg.deepstack_visual_indexes:
                stacked.append(self.deepstack[cfg.deepstack_visual_indexes.index(i)](x))
        tokens = self.merger(x)
        deep = jnp.stack(stacked) if stacked else jnp.zeros((0,) + tokens.shape, tokens.dtype)
        return tokens, deep
