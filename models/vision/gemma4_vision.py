"""Gemma 4's image encoder: its vision tower (Gemma4VisionModel) and the embedder into the
text width (Gemma4MultimodalEmbedder).

Not SigLIP: images keep their aspect ratio, so an image is a variable number of patches
(each a flattened P x P x C block, raster order) with (x, y) patch coordinates, padded to
the processor's fixed `max_patches` (padding rows mask out of attention and pooling, as
transformers runs it), so one compiled shape serves every image. The layers are Gemma's
sandwich (plain-weight RMSNorms before and after attention and the gated MLP), with q/k
RMSNorms, a weightless V norm, softmax scale 1 and an axial 2D rotary: the first half of
each head turns with the patch's x, the second with its y. The position embedding is the
sum of an x table row and a y table row. The pooler averages each k x k block of patches
into one soft token (raster order over the pooled grid) and scales by sqrt(hidden); an
optional standardization (`standardize`), then a weightless RMSNorm and a projection to
the text width. `use_clipped_linears` clamps each linear's input and output to the
checkpoint's bounds.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxfill.models.vision.attention import segment_attention
from jaxfill.models.vision.qwen3_vl import ACT, _w, _zeros, rotate_half


@dataclasses.dataclass(frozen=True)
class Gemma4VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    patch_size: int
    pooling: int  # k: each k x k block of patches is one soft token
    position_embedding_size: int
    text_hidden_size: int
    max_soft_tokens: int = 280  # the processor's; max_patches = this * k^2
    rms_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 100.0
    clipped: bool = False  # use_clipped_linears
    standardize: bool = False
    dtype: object = jnp.float32

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling ** 2

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size ** 2


def gemma4_vision_config(hf: dict, max_soft_tokens: int = 280, dtype=jnp.float32) -> Gemma4VisionConfig:
    """From a Gemma4ForConditionalGeneration config.json; max_soft_tokens is the processor's."""
    v, t = hf["vision_config"], hf.get("text_config") or {}
    act = v.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ACT:
        raise ValueError(f"vision hidden_activation {act!r} is not one of {tuple(ACT)}")
    rope = v.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"vision rope_parameters.rope_type {rope['rope_type']!r}: only 'axial' is Gemma 4's")
    if v.get("attention_bias"):
        raise ValueError("vision attention_bias=true is not supported (Gemma 4's tower has no biases)")
    heads = v.get("num_attention_heads", 12)
    return Gemma4VisionConfig(
        depth=v.get("num_hidden_layers", 16), hidden_size=v.get("hidden_size", 768),
        intermediate_size=v.get("intermediate_size", 3072), num_heads=heads,
        num_kv_heads=v.get("num_key_value_heads", heads), head_dim=v.get("head_dim", 64),
        patch_size=v.get("patch_size", 16), pooling=v.get("pooling_kernel_size", 3),
        position_embedding_size=v.get("position_embedding_size", 10240), text_hidden_size=t["hidden_size"],
        max_soft_tokens=max_soft_tokens, rms_norm_eps=float(v.get("rms_norm_eps", 1e-6)), hidden_act=act,
        rope_theta=float(rope.get("rope_theta", 100.0)), clipped=bool(v.get("use_clipped_linears", False)),
        standardize=bool(v.get("standardize", False)), dtype=dtype)


def rms(x, eps: float):  # [..., n] -> [..., n] f32, no weight
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + eps)


class Norm(nnx.Module):
    def __init__(self, n: int, eps: float, dtype):
        self.w, self.eps = _zeros((n,), dtype, 1.0), eps

    def __call__(self, x):  # [..., n]: w * x / rms(x), in f32
        return (rms(x, self.eps) * self.w[...].astype(jnp.float32)).astype(x.dtype)


class ClipLinear(nnx.Module):
    """x @ w, no bias; with `clipped`, input and output clamped to the checkpoint's bounds."""

    def __init__(self, rngs, n_in: int, n_out: int, cfg: Gemma4VisionConfig):
        self.w = _w(rngs, (n_in, n_out), cfg.dtype)
        self.clipped = cfg.clipped
        if cfg.clipped:  # (input min, input max, output min, output max)
            self.bounds = nnx.Param(jnp.asarray([-np.inf, np.inf, -np.inf, np.inf], jnp.float32),
                                    out_sharding=("vision",), eager_sharding=False)

    def __call__(self, x):  # [N, in] -> [N, out]
        if not self.clipped:
            return x @ self.w[...]
        b = self.bounds[...]
        return jnp.clip(jnp.clip(x, b[0], b[1]) @ self.w[...], b[2], b[3])


def axial_rope(xy: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin [N, D]: the first D/2 turn with x, the second with y, each half rotate-half
    laid out over D/4 frequencies."""
    half = head_dim // 2
    inv = (1.0 / theta ** (np.arange(0, half, 2, dtype=np.float32) / half)).astype(np.float32)
    ang = xy.astype(jnp.float32)[:, :, None] * inv  # [N, 2, D/4]
    angles = jnp.concatenate([ang[:, 0], ang[:, 0], ang[:, 1], ang[:, 1]], -1)
    return jnp.cos(angles), jnp.sin(angles)


def turn(x, cos, sin):  # x [N, H, D]; cos, sin [N, D]: each half rotates on its own
    half = x.shape[-1] // 2
    c, s = cos[:, None], sin[:, None]
    xf = x.astype(jnp.float32)
    parts = [xf[..., :half] * c[..., :half] + rotate_half(xf[..., :half]) * s[..., :half],
             xf[..., half:] * c[..., half:] + rotate_half(xf[..., half:]) * s[..., half:]]
    return jnp.concatenate(parts, -1).astype(x.dtype)


class Layer(nnx.Module):
    def __init__(self, cfg: Gemma4VisionConfig, rngs):
        e, d, eps, hd = cfg.hidden_size, cfg.dtype, cfg.rms_norm_eps, cfg.head_dim
        self.norms = nnx.List([Norm(e, eps, d) for _ in range(4)])  # input, post-attention, pre-MLP, post-MLP
        self.q = ClipLinear(rngs, e, cfg.num_heads * hd, cfg)
        self.k = ClipLinear(rngs, e, cfg.num_kv_heads * hd, cfg)
        self.v = ClipLinear(rngs, e, cfg.num_kv_heads * hd, cfg)
        self.o = ClipLinear(rngs, cfg.num_heads * hd, e, cfg)
        self.q_norm, self.k_norm = Norm(hd, eps, d), Norm(hd, eps, d)
        self.gate = ClipLinear(rngs, e, cfg.intermediate_size, cfg)
        self.up = ClipLinear(rngs, e, cfg.intermediate_size, cfg)
        self.down = ClipLinear(rngs, cfg.intermediate_size, e, cfg)
        self.cfg = cfg

    def attend(self, x, cos, sin, valid):  # x [N, E]; cos, sin [N, D]; valid [N] bool (keys)
        cfg, n = self.cfg, x.shape[0]
        q = turn(self.q_norm(self.q(x).reshape(n, cfg.num_heads, cfg.head_dim)), cos, sin)
        k = turn(self.k_norm(self.k(x).reshape(n, cfg.num_kv_heads, cfg.head_dim)), cos, sin)
        v = rms(self.v(x).reshape(n, cfg.num_kv_heads, cfg.head_dim), cfg.rms_norm_eps).astype(x.dtype)
        group = cfg.num_heads // cfg.num_kv_heads
        k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
        # softmax scale 1 (q/k are normed); a padding query sees nothing here (transformers lets it see the
        # valid keys), which changes only padding rows, and the pooler drops them
        attn = segment_attention(q, k, v, jnp.where(valid, 0, -1).astype(jnp.int32), 1.0)
        return self.o(attn.reshape(n, -1))

    def __call__(self, x, cos, sin, valid):  # [N, E] -> [N, E]
        x = x + self.norms[1](self.attend(self.norms[0](x), cos, sin, valid))
        h = self.norms[2](x)
        return x + self.norms[3](self.down(ACT[self.cfg.hidden_act](self.gate(h)) * self.up(h)))


class Gemma4VisionEncoder(nnx.Module):
    def __init__(self, cfg: Gemma4VisionConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        d, e = cfg.dtype, cfg.hidden_size
        self.patch = _w(rngs, (cfg.patch_dim, e), d)
        self.pos_table = _w(rngs, (2, cfg.position_embedding_size, e), d)  # x rows, y rows
        self.layers = nnx.List([Layer(cfg, rngs) for _ in range(cfg.depth)])
        self.std_bias, self.std_scale = _zeros((e,), jnp.float32), _zeros((e,), jnp.float32, 1.0)
        self.proj = _w(rngs, (e, cfg.text_hidden_size), d)

    def __call__(self,
                 patches: jax.Array,  # [M, 3*P*P] f32 in [0, 1], (P, P, C) per patch; padding rows anything
                 xy: jax.Array,  # [M, 2] int32 (x, y) patch coordinates; (-1, -1) on padding
                 token: jax.Array,  # [M] int32: the soft token a patch pools into; -1 on padding
                 ) -> jax.Array:  # [max_soft_tokens, text E]: the soft tokens, the used ones first
        cfg = self.cfg
        valid = token >= 0
        at = jnp.maximum(xy, 0)
        pos = self.pos_table[0][at[:, 0]] + self.pos_table[1][at[:, 1]]
        x = (2.0 * (patches.astype(jnp.float32) - 0.5)).astype(cfg.dtype) @ self.patch[...]
        x = x + jnp.where(valid[:, None], pos, 0.0)
        cos, sin = axial_rope(xy, cfg.head_dim, cfg.rope_theta)
        for layer in self.layers:
            x = layer(x, cos, sin, valid)
        x = jnp.where(valid[:, None], x, 0.0).astype(jnp.float32)
        pooled = jax.ops.segment_sum(x, jnp.where(valid, token, cfg.max_soft_tokens),
                                     num_segments=cfg.max_soft_tokens + 1)[:-1] / cfg.pooling ** 2
        pooled = pooled * np.float32(cfg.hidden_size ** 0.5)
        if cfg.standardize:
            pooled = (pooled - self.std_bias[...]) * self.std_scale[...]
        return rms(pooled.astype(cfg.dtype), cfg.rms_norm_eps).astype(cfg.dtype) @ self.proj[...]


def soft_tokens(xy: np.ndarray, pooling: int) -> np.ndarray:  # [M, 2] (x, y), -1 padding -> [M] int32
    """Each patch's soft token: its k x k block in raster order over the pooled grid (x
    fastest), -1 on padding; transformers' _avg_pool_by_positions order."""
    valid = (xy >= 0).all(-1)
    width = int(xy[valid, 0].max()) + 1
    idx = xy[:, 0] // pooling + (width // pooling) * (xy[:, 1] // pooling)
    return np.where(valid, idx, -1).astype(np.int32)
