"""Building blocks of the decoders. Every weight carries logical axis names."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

import jaxfill.models.fp8_block as fp8_block
import jaxfill.models.int_group as int_group
from jaxfill.models.lora import add_delta
from jaxfill.models.quant import input_axes, qeinsum, quantize
from jaxfill.models.parallel.vocab import vocab_parallel_embed
from jaxfill.models.sharding import constrain


def next_key(rngs: nnx.Rngs) -> jax.Array:
    """The key `rngs.params()` gives, without its `count[...] += 1`: under nnx.eval_shape (every
    checkpoint load builds the model abstractly) that indexed update asks the traced count
    for its sharding, and jax's refusal builds a message that walks the whole trace so far:
    quadratic in the model's size (SmolLM2-135M kept int_group: 24 s of a 37 s load)."""
    stream = rngs.params
    key = jax.random.fold_in(stream.key[...], stream.count[...])
    stream.count.set_value(stream.count[...] + 1)
    return key


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], dtype,
          init: str = "normal", scale: float = 0.02) -> nnx.Param:
    """A parameter with logical axis names (mapped to mesh axes in models/sharding.py)."""
    assert len(shape) == len(axes), (shape, axes)
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    elif init == "one_plus_normal":
        value = (1.0 + scale * jax.random.normal(next_key(rngs), shape, jnp.float32)).astype(dtype)
    else:
        value = (scale * jax.random.normal(next_key(rngs), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def projection(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], dtype, num_in: int,
               weight_dtype="auto", stacked: int = 0, name: str = "", init_scale: float = 0.02,
               ) -> tuple[nnx.Param, nnx.Param | None]:
    """A projection weight [stacked..., in..., out...] and its scales: None for "auto";
    per output channel for "int8" (stacked experts get their own); per block for an
    fp8_block.Fp8Format (ModelConfig.weight_form), the layout of fp8_block.LAYOUTS[name]
    carried as the scale's metadata; for an int_group.IntGroupFormat packed codes and an
    int_group.IntGroupScales. All quantize the very values the float model would have, so
    a random-init quantized model is the float one quantized."""
    w = param(rngs, shape, axes, dtype, scale=init_scale)
    if weight_dtype == "auto":
        return w, None
    if isinstance(weight_dtype, int_group.IntGroupFormat):
        if weight_dtype.experts_only and not stacked:  # a checkpoint that leaves it unquantized
            return w, None
        return int_group.projection(w[...], axes, num_in, weight_dtype.of(name), stacked)
    if isinstance(weight_dtype, fp8_block.Fp8Format):
        layout, block = fp8_block.LAYOUTS[name], weight_dtype.block
        q, scale = fp8_block.quantize(w[...], layout, block, fp8_block.FORMATS[weight_dtype.dtype])
        return (nnx.Param(q, out_sharding=axes, eager_sharding=False),
                nnx.Param(scale, out_sharding=fp8_block.scale_axes(axes, layout, block), eager_sharding=False,
                          **{fp8_block.META: (block, layout)}))
    q, scale = quantize(w[...], num_in, stacked)
    scale_axes = axes[:stacked] + axes[stacked + num_in:]
    return (nnx.Param(q, out_sharding=axes, eager_sharding=False),
            nnx.Param(scale, out_sharding=scale_axes, eager_sharding=False))


def int8_form(config) -> str:
    """The weight form of a projection with an int8 path but no fp8 block layout (the
    linear mixers', the indexer's, MLA's head gate): int8 with model.weight_dtype = int8,
    else the model dtype (an fp8 checkpoint's are dequantized at load)."""
    return "int8" if config.weight_dtype == "int8" else "auto"


def mixer_projection(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], dtype, weight_dtype, name: str,
                     init_scale: float = 0.02) -> tuple[nnx.Param, nnx.Param | None]:
    """`projection` with its input axes from quant.input_axes, the rule the loader and
    quantize_model use too, so the model, its scales and a loaded checkpoint agree."""
    return projection(rngs, shape, axes, dtype, input_axes(name, len(shape)), weight_dtype, name=name,
                      init_scale=init_scale)


def project(module: nnx.Module, name: str, eq: str, x: jax.Array) -> jax.Array:
    """einsum(eq, x, module.<name>) through the weight's form (quant.qeinsum): float, or
    int8 times `<name>_scale` per output channel, whose axes must end eq's result."""
    return qeinsum(eq, x, getattr(module, name)[...], getattr(module, name + "_scale"))


class RMSNorm(nnx.Module):
    """RMSNorm in the three spellings of NormConfig.kind (models/config/sections.py); they
    differ only in where the f32 -> dtype cast falls and in Gemma's (1 + w). kind "layer":
    LayerNorm instead, the mean taken out and a bias added, in f32 (Phi-3.5-MoE)."""

    def __init__(self, dim: int, eps: float, dtype, rngs: nnx.Rngs, axis_name: str = "norm",
                 kind: str = "rms", shape: tuple[int, ...] | None = None, axes: tuple[str, ...] | None = None):
        shape, axes = shape or (dim,), axes or (axis_name,)
        # Random-init scale (not ones) so tests would catch a norm that ignores its weight.
        init = "normal" if kind == "rms_one_plus" else "one_plus_normal"
        self.weight = param(rngs, shape, axes, dtype, init=init, scale=0.1)
        self.bias = param(rngs, shape, axes, dtype, scale=0.1) if kind == "layer" else None
        self.eps, self.kind, self.ndim = eps, kind, len(shape)

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., *weight.shape] -> same
        xf = x.astype(jnp.float32)
        over = tuple(range(-self.ndim, 0))
        if self.kind == "layer":
            xf = xf - jnp.mean(xf, axis=over, keepdims=True)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=over, keepdims=True) + self.eps)
        w = self.weight[...]
        if self.kind == "layer":
            return (w.astype(jnp.float32) * xf + self.bias[...].astype(jnp.float32)).astype(x.dtype)
        if self.kind == "rms":
            return w * xf.astype(x.dtype)
        if self.kind == "rms_f32":
            return (w.astype(jnp.float32) * xf).astype(x.dtype)
        return (xf * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def unit_rms(x: jax.Array, eps: float) -> jax.Array:  # [..., D] -> same
    """RMSNorm over the last axis without a weight, in f32 (Gemma 4's V norm and router input)."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
               "relu2": lambda x: jnp.square(jax.nn.relu(x))}


class GatedMLP(nnx.Module):
    def __init__(self, hidden: int, intermediate: int, dtype, rngs: nnx.Rngs, weight_dtype="auto",
                 activation: str = "silu", scales: tuple[float, float] = (1.0, 1.0)):
        """`scales`: the gate's pre-activation and the output times these (Falcon-H1's
        mlp_multipliers; ModelConfig.mlp_scales)."""
        wd = weight_dtype
        self.activation, self.scales = activation, tuple(scales)
        self.gate, self.gate_scale = projection(rngs, (hidden, intermediate), ("embed", "mlp"), dtype, 1, wd,
                                                name="gate")
        self.up, self.up_scale = projection(rngs, (hidden, intermediate), ("embed", "mlp"), dtype, 1, wd, name="up")
        self.down, self.down_scale = projection(rngs, (intermediate, hidden), ("mlp", "embed"), dtype, 1, wd,
                                                name="down")

    def __call__(self, x: jax.Array,  # [T, E] -> [T, E]
                 lora_slots: jax.Array | None = None) -> jax.Array:  # [T] i32 each row's LoRA slot (models/lora.py)
        with jax.named_scope("mlp"):
            g = add_delta(self, "gate", x, qeinsum("te,ei->ti", x, self.gate[...], self.gate_scale), lora_slots)
            if self.scales[0] != 1.0:
                g = g * jnp.asarray(self.scales[0], g.dtype)
            up = add_delta(self, "up", x, qeinsum("te,ei->ti", x, self.up[...], self.up_scale), lora_slots)
            h = ACTIVATIONS[self.activation](g) * up
            h = constrain(h, ("tokens", "act_mlp"))
            out = add_delta(self, "down", h, qeinsum("ti,ie->te", h, self.down[...], self.down_scale), lora_slots)
            if self.scales[1] != 1.0:
                out = out * jnp.asarray(self.scales[1], out.dtype)
            return constrain(out, ("tokens", "act_embed"))  # all-reduce over tensor


class XIELU(nnx.Module):
    """xIELU (arXiv 2411.13010; Apertus' MLP), with four scalars per layer as transformers
    stores them (alpha_p and alpha_n [1], beta and eps []):

        x > 0:  a_p * x * x + beta * x
        else:   (expm1(min(x, eps)) - x) * a_n + beta * x

    a_p = softplus(alpha_p), a_n = beta + softplus(alpha_n); all in x's dtype, as
    transformers' Python path runs it. Random init: transformers' (a_p = 0.8, a_n = 0.8)."""

    def __init__(self, dtype, alpha_p: float = 0.8, alpha_n: float = 0.8, beta: float = 0.5, eps: float = -1e-6):
        def scalar(value, shape):
            return nnx.Param(jnp.full(shape, value, dtype), out_sharding=(None,) * len(shape), eager_sharding=False)

        inverse_softplus = lambda y: math.log(math.expm1(y))  # noqa: E731
        self.alpha_p = scalar(inverse_softplus(alpha_p), (1,))
        self.alpha_n = scalar(inverse_softplus(alpha_n - beta), (1,))
        self.beta = scalar(beta, ())
        self.eps = scalar(eps, ())

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = x.dtype
        beta, eps = self.beta[...].astype(dt), self.eps[...].astype(dt)
        a_p = jax.nn.softplus(self.alpha_p[...].astype(dt))
        a_n = beta + jax.nn.softplus(self.alpha_n[...].astype(dt))
        return jnp.where(x > 0, a_p * x * x + beta * x, (jnp.expm1(jnp.minimum(x, eps)) - x) * a_n + beta * x)


class MLP(nnx.Module):
    """The ungated MLP, act(x W_up) W_down (Nemotron-H's and Arcee's squared ReLU, Apertus'
    xIELU, whose learned scalars live here as `act_fn`)."""

    def __init__(self, hidden: int, intermediate: int, dtype, rngs: nnx.Rngs, weight_dtype="auto",
                 activation: str = "relu2"):
        wd = weight_dtype
        self.activation = activation
        self.up, self.up_scale = projection(rngs, (hidden, intermediate), ("embed", "mlp"), dtype, 1, wd, name="up")
        self.down, self.down_scale = projection(rngs, (intermediate, hidden), ("mlp", "embed"), dtype, 1, wd,
                                                name="down")
        self.act_fn = XIELU(dtype) if activation == "xielu" else None

    def __call__(self, x: jax.Array) -> jax.Array:  # [T, E] -> [T, E]
        with jax.named_scope("mlp"):
            act = self.act_fn if self.act_fn is not None else ACTIVATIONS[self.activation]
            h = act(qeinsum("te,ei->ti", x, self.up[...], self.up_scale))
            h = constrain(h, ("tokens", "act_mlp"))
            out = qeinsum("ti,ie->te", h, self.down[...], self.down_scale)
            return constrain(out, ("tokens", "act_embed"))


class Embed(nnx.Module):
    def __init__(self, vocab: int, hidden: int, dtype, rngs: nnx.Rngs):
        self.embedding = param(rngs, (vocab, hidden), ("vocab", "embed"), dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:  # [T] -> [T, E]
        return vocab_parallel_embed(self.embedding[...], tokens)

    def attend(self, x: jax.Array) -> jax.Array:  # [S, E] -> [S, V], tied LM head
        return constrain(x @ self.embedding[...].T, ("seqs", "act_vocab"))
