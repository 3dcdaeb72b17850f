"""Rotary embeddings as transformers computes them: the inverse frequencies of each rope
type (default, linear, llama3, yarn, longrope) in float32, and the rotate-half rotation.

A layer's rope is (inv_freq [D/2], scale): yarn and longrope multiply cos and sin by their
attention factor; a NoPE layer (SmolLM3) has inv_freq 0 and scale 1, which rotates nothing.

longrope (Phi-3 128k, Phi-3.5-MoE) turns with its `short_factor`s: what transformers uses
while a sequence is within `original_max_position_embeddings`. Past it transformers re-ropes
the whole sequence with the `long_factor`s, which keys cached as they came cannot follow,
so the families cap the model's context there (models/families/base.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # what a family accepts unless it says otherwise
# beside them: longrope (Phi-3, Phi-3.5-MoE) and proportional (Gemma 4), which a family names in its rope_types


def theta_powers(head_dim: int, theta: float) -> np.ndarray:  # [D/2] f32: theta ** (2i / D)
    """The power in float64, rounded once to f32: torch's float32 pow (what transformers
    runs) is correctly rounded for nearly every exponent, numpy's float32 pow is not (13
    of 64 values off by an ulp for llama3's theta). One ulp of a frequency is a phase
    error of position x ulp: 0.06 rad at a million tokens (tests/test_rope_long.py)."""
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    return (np.float64(theta) ** exponent.astype(np.float64)).astype(np.float32)


def base_inv_freq(head_dim: int, theta: float) -> np.ndarray:  # [D/2] f32
    return (np.float32(1.0) / theta_powers(head_dim, theta)).astype(np.float32)


def rope_parameters(head_dim: int, theta: float, scaling: dict | None,
                    max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """(inv_freq [D/2] f32, cos/sin scale) of one rope setting."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    inv = base_inv_freq(head_dim, theta)
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return (inv / np.float32(scaling["factor"])).astype(np.float32), 1.0
    if kind == "llama3":
        return _llama3(inv, scaling), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling, max_position_embeddings)
    if kind == "longrope":
        return _longrope(head_dim, theta, scaling, max_position_embeddings)
    if kind == "proportional":
        return _proportional(head_dim, theta, scaling), 1.0
    raise ValueError(f"rope type {kind!r} is not one of {ROPE_TYPES + ('longrope', 'proportional')}")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    """Inverse frequencies of a rope type that needs no scale (default, linear, llama3)."""
    inv, scale = rope_parameters(head_dim, theta, scaling, 0)
    assert scale == 1.0, scaling
    return inv


def _llama3(inv: np.ndarray, scaling: dict) -> np.ndarray:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, scaling: dict, max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """YaRN (arXiv 2309.00071): interpolate the slow frequencies, keep the fast ones, ramp
    between them; cos/sin scaled by the attention factor."""
    factor = float(scaling["factor"])
    original = scaling.get("original_max_position_embeddings") or max_position_embeddings
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        else:
            attention = yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    pos_freqs = theta_powers(dim, theta)
    inv = ((1.0 / (np.float32(factor) * pos_freqs)) * (1 - extrapolation)
           + (1.0 / pos_freqs) * extrapolation)
    return inv.astype(np.float32), float(attention)


def _longrope(dim: int, theta: float, scaling: dict, max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """LongRoPE's short factors: inv_freq = 1 / (short_factor * theta ** (2i / D)), cos/sin
    times `attention_factor` (or, absent, sqrt(1 + log(factor) / log(original)))."""
    factors = np.asarray(scaling["short_factor"], np.float32)
    if factors.shape != (dim // 2,):
        raise ValueError(f"longrope short_factor has {factors.size} values, the rope turns {dim // 2} pairs")
    attention = scaling.get("attention_factor")
    if attention is None:
        original = scaling["original_max_position_embeddings"]
        factor = scaling.get("factor") or max_position_embeddings / original
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    inv = np.float32(1.0) / (factors * theta_powers(dim, theta))
    return inv.astype(np.float32), float(attention)


def _proportional(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """Gemma 4's proportional rope: the first partial_rotary_factor of each half-head's pairs
    turn at theta ** (2i / head_dim) (the whole head's exponents, not the turned part's), the
    rest at frequency 0; all divided by `factor`. The rotation stays rotate-half over the
    whole head, so it is not partial rotary (which would pair other dims)."""
    turned = int(float(scaling.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    inv = base_inv_freq(head_dim, theta)
    inv[turned:] = 0.0
    return (inv / np.float32(scaling.get("factor", 1.0))).astype(np.float32)


def mrope_axes(section: tuple[int, ...], half: int) -> np.ndarray:  # [D/2] int32: 0 = t, 1 = h, 2 = w
    """Which position axis turns each rotary frequency in Qwen3-VL's interleaved layout:
    frequency i follows h where i % 3 == 1 and i < 3 * section[1], w where i % 3 == 2 and
    i < 3 * section[2], t elsewhere (its section is what remains)."""
    axes = np.zeros(half, np.int32)
    for axis in (1, 2):
        axes[axis:3 * section[axis]:3] = axis
    return axes


def mrope_positions(pos3: jax.Array,  # [3, T] int32: (t, h, w) of each row
                    axes: np.ndarray,  # [D/2] from mrope_axes
                    ) -> jax.Array:  # [T, D/2] int32: the position each frequency turns with
    return jnp.take(pos3, jnp.asarray(axes), axis=0).T


def apply_rope(x: jax.Array,  # [T, H, D]
               positions: jax.Array,  # [T] int32, or [T, R/2] a position per frequency (mrope_positions)
               inv_freq,  # [R/2] f32 (numpy or traced), R <= D the dims turned
               scale=1.0,  # [] cos/sin multiplier (yarn's attention factor)
               interleaved: bool = False,
               in_f32: bool = False,
               ) -> jax.Array:  # [T, H, D]
    """Rotate-half rotary embedding (the Hugging Face Llama convention) over the first R
    dims of each head; the rest pass through (partial rotary).

    `interleaved`: the R dims turn in (even, odd) pairs (GLM's rotate-every-two); they are
    laid out evens first, then odds, and turned rotate-half: the same values, permuted the
    same way in q and k, so every score q.k is unchanged. `in_f32`: cos, sin and the
    rotation in f32, x rounded once at the end (OLMo 2/3, whose transformers code keeps
    cos and sin in f32); otherwise in x's dtype, as Llama's code casts them."""
    rot = 2 * inv_freq.shape[-1]
    if interleaved:
        x = jnp.concatenate([x[..., 0:rot:2], x[..., 1:rot:2], x[..., rot:]], axis=-1)
    if in_f32 and x.dtype != jnp.float32:
        return apply_rope(x.astype(jnp.float32), positions, inv_freq, scale).astype(x.dtype)
    if rot < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rot], positions, inv_freq, scale), x[..., rot:]], axis=-1)
    per_freq = positions if positions.ndim == 2 else positions[:, None]
    freqs = per_freq.astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [T, D]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if not (isinstance(scale, float) and scale == 1.0):
        cos, sin = cos * scale, sin * scale
    cos, sin = cos.astype(x.dtype)[:, None, :], sin.astype(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
