"""Building blocks of a Llama-family decoder. Every weight carries logical axis names."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxfill.models.quant import qeinsum, quantize
from jaxfill.models.sharding import constrain, vocab_parallel_embed


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], dtype,
          init: str = "normal", scale: float = 0.02) -> nnx.Param:
    """A parameter with logical axis names (mapped to mesh axes in models/sharding.py)."""
    assert len(shape) == len(axes), (shape, axes)
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    elif init == "one_plus_normal":
        value = (1.0 + scale * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    else:
        value = (scale * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def projection(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], dtype, num_in: int,
               weight_dtype: str = "auto") -> tuple[nnx.Param, nnx.Param | None]:
    """A projection weight [in..., out...] and its per-output-channel scales (None unless
    weight_dtype is "int8"). int8 quantizes the very values the float model would have, so
    a random-init int8 model is the float one quantized (models/quant.py)."""
    w = param(rngs, shape, axes, dtype)
    if weight_dtype == "auto":
        return w, None
    q, scale = quantize(w[...], num_in)
    return (nnx.Param(q, out_sharding=axes, eager_sharding=False),
            nnx.Param(scale, out_sharding=axes[num_in:], eager_sharding=False))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype, rngs: nnx.Rngs, axis_name: str = "norm"):
        # Random-init scale (not ones) so tests would catch a norm that ignores its weight.
        self.weight = param(rngs, (dim,), (axis_name,), dtype, init="one_plus_normal", scale=0.1)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:  # [T, E] -> [T, E]
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    """Inverse frequencies [D/2] in float32, as transformers computes them (llama3 scaling incl.)."""
    inv = (1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))))
    inv = inv.astype(np.float32)
    if not scaling:
        return inv
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array,  # [T, H, D]
               positions: jax.Array,  # [T] int32
               inv_freq: np.ndarray,  # [D/2]
               ) -> jax.Array:  # [T, H, D]
    """Rotate-half rotary embedding (the Hugging Face Llama convention)."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [T, D]
    cos = jnp.cos(emb).astype(x.dtype)[:, None, :]
    sin = jnp.sin(emb).astype(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


class GatedMLP(nnx.Module):
    def __init__(self, hidden: int, intermediate: int, dtype, rngs: nnx.Rngs, weight_dtype: str = "auto"):
        wd = weight_dtype
        self.gate, self.gate_scale = projection(rngs, (hidden, intermediate), ("embed", "mlp"), dtype, 1, wd)
        self.up, self.up_scale = projection(rngs, (hidden, intermediate), ("embed", "mlp"), dtype, 1, wd)
        self.down, self.down_scale = projection(rngs, (intermediate, hidden), ("mlp", "embed"), dtype, 1, wd)

    def __call__(self, x: jax.Array) -> jax.Array:  # [T, E] -> [T, E]
        with jax.named_scope("mlp"):
            h = (jax.nn.silu(qeinsum("te,ei->ti", x, self.gate[...], self.gate_scale))
                 * qeinsum("te,ei->ti", x, self.up[...], self.up_scale))
            h = constrain(h, ("tokens", "act_mlp"))
            out = qeinsum("ti,ie->te", h, self.down[...], self.down_scale)
            return constrain(out, ("tokens", "act_embed"))  # all-reduce over tensor



class Embed(nnx.Module):
    def __init__(self, vocab: int, hidden: int, dtype, rngs: nnx.Rngs):
        self.embedding = param(rngs, (vocab, hidden), ("vocab", "embed"), dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:  # [T] -> [T, E]
        return vocab_parallel_embed(self.embedding[...], tokens)

    def attend(self, x: jax.Array) -> jax.Array:  # [S, E] -> [S, V], tied LM head
        return constrain(x @ self.embedding[...].T, ("seqs", "act_vocab"))
