"""Gemma 3's image encoder: the SigLIP vision tower and Gemma3MultiModalProjector.

One image is always image_size x image_size (the processor resizes every image to it), so
the tower runs one fixed shape: patches (a stride = kernel conv, here one matmul over each
flattened C x P x P patch, raster order), plus a learned position table of exactly that
many rows, then pre-LN encoder layers with full (bidirectional) attention, then
post_layernorm. The projector average-pools the patch grid down to mm_tokens_per_image
tokens, norms them with Gemma's RMSNorm (1 + w) and projects them to the text width.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfill.models.vision.attention import segment_attention
from jaxfill.models.vision.qwen3_vl import ACT, Linear, _w, _zeros


@dataclasses.dataclass(frozen=True)
class SiglipConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    image_size: int
    patch_size: int
    text_hidden_size: int  # the projector's output width
    mm_tokens_per_image: int
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    dtype: object = jnp.float32

    @property
    def side(self) -> int:  # patches per image side
        return self.image_size // self.patch_size

    @property
    def tokens_side(self) -> int:
        return int(round(self.mm_tokens_per_image ** 0.5))

    @property
    def pool(self) -> int:  # the projector's average-pool kernel (= stride)
        return self.side // self.tokens_side


def siglip_config(hf: dict, dtype=jnp.float32) -> SiglipConfig:
    """From a Gemma3ForConditionalGeneration config.json."""
    v, t = hf["vision_config"], hf.get("text_config") or {}
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ACT:
        raise ValueError(f"vision hidden_act {act!r} is not one of {tuple(ACT)}")
    # vision_use_head: SigLIP's pooling head, if any, feeds nothing here (Gemma 3 reads last_hidden_state)
    cfg = SiglipConfig(
        depth=v["num_hidden_layers"], hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
        num_heads=v["num_attention_heads"], image_size=v["image_size"], patch_size=v["patch_size"],
        text_hidden_size=t["hidden_size"], mm_tokens_per_image=hf.get("mm_tokens_per_image", 256),
        layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)), hidden_act=act,
        in_channels=v.get("num_channels", 3), dtype=dtype)
    if cfg.tokens_side ** 2 != cfg.mm_tokens_per_image or cfg.side % cfg.tokens_side:
        raise ValueError(f"mm_tokens_per_image={cfg.mm_tokens_per_image} must be a square whose side divides the "
                         f"{cfg.side} patches per image side")
    return cfg


class LayerNorm(nnx.Module):
    def __init__(self, n: int, eps: float, dtype):
        self.scale, self.bias, self.eps = _zeros((n,), dtype, 1.0), _zeros((n,), dtype), eps

    def __call__(self, x):  # [N, n]
        xf = x.astype(jnp.float32)
        mean = xf.mean(-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(jnp.square(xf - mean).mean(-1, keepdims=True) + self.eps)
        return (y * self.scale[...] + self.bias[...]).astype(x.dtype)


class Layer(nnx.Module):
    def __init__(self, cfg: SiglipConfig, rngs):
        e, d, eps = cfg.hidden_size, cfg.dtype, cfg.layer_norm_eps
        self.norm1, self.norm2 = LayerNorm(e, eps, d), LayerNorm(e, eps, d)
        self.q, self.k, self.v, self.o = (Linear(rngs, e, e, d) for _ in range(4))
        self.fc1, self.fc2 = Linear(rngs, e, cfg.intermediate_size, d), Linear(rngs, cfg.intermediate_size, e, d)
        self.heads, self.act = cfg.num_heads, cfg.hidden_act

    def __call__(self, x):  # [N, E]: one image's patches, every one seeing every other
        n, e = x.shape
        h = self.norm1(x)
        q, k, v = (f(h).reshape(n, self.heads, e // self.heads) for f in (self.q, self.k, self.v))
        attn = segment_attention(q, k, v, jnp.zeros((n,), jnp.int32), (e // self.heads) ** -0.5)
        x = x + self.o(attn.reshape(n, e))
        return x + self.fc2(ACT[self.act](self.fc1(self.norm2(x))))


class SiglipEncoder(nnx.Module):
    def __init__(self, cfg: SiglipConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        d = cfg.dtype
        self.patch = Linear(rngs, cfg.in_channels * cfg.patch_size ** 2, cfg.hidden_size, d)
        self.pos_table = _w(rngs, (cfg.side ** 2, cfg.hidden_size), d)
        self.layers = nnx.List([Layer(cfg, rngs) for _ in range(cfg.depth)])
        self.post_norm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, d)
        self.mm_norm = _zeros((cfg.hidden_size,), d)  # Gemma RMSNorm: scales by 1 + w
        self.mm_proj = _w(rngs, (cfg.hidden_size, cfg.text_hidden_size), d)

    def tower(self, image: jax.Array) -> jax.Array:  # [C, S, S] normalized pixels -> [side^2, E]
        cfg = self.cfg
        c, p, s = cfg.in_channels, cfg.patch_size, cfg.side
        patches = image.astype(cfg.dtype).reshape(c, s, p, s, p).transpose(1, 3, 0, 2, 4).reshape(s * s, c * p * p)
        x = self.patch(patches) + self.pos_table[...]
        for layer in self.layers:
            x = layer(x)
        return self.post_norm(x)

    def project(self, x: jax.Array) -> jax.Array:  # [side^2, E] -> [mm_tokens, text E]
        """Average-pool each pool x pool block of the patch grid (tokens in raster order),
        RMS-norm in f32 with (1 + w), project."""
        cfg = self.cfg
        t, k = cfg.tokens_side, cfg.pool
        pooled = x.reshape(t, k, t, k, cfg.hidden_size).mean((1, 3)).reshape(t * t, cfg.hidden_size)
        pf = pooled.astype(jnp.float32)
        normed = pf * jax.lax.rsqrt(jnp.square(pf).mean(-1, keepdims=True) + cfg.layer_norm_eps)
        normed = (normed * (1.0 + self.mm_norm[...].astype(jnp.float32))).astype(x.dtype)
        return normed @ self.mm_proj[...]

    def __call__(self, image: jax.Array) -> jax.Array:  # [C, S, S] -> [mm_tokens, text E]
        return self.project(self.tower(image))
