"""Gemma 4's per-layer inputs (the "E" models' PLE): beside the residual stream, every layer
gets its own P-wide input, computed once per step from the tokens and their embeddings:

    token = table[tokens] * sqrt(P)                       [T, L, P] (one row holds all L layers)
    context = norm((x @ W) / sqrt(hidden))                [T, L, P] (x: the scaled embeddings)
    inputs = (context + token) / sqrt(2)

and each layer adds post_norm(gelu(h @ gate) * input @ proj) to its output, before its
layer scalar (models/decoder.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfill.models.config import ModelConfig
from jaxfill.models.layers import ACTIVATIONS, Embed, RMSNorm, param
from jaxfill.models.sharding import constrain


class PerLayerInputs(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c, dt = config, config.jnp_dtype
        width = c.num_layers * c.per_layer_input_size
        self.embed = Embed(c.per_layer_vocab_size or c.vocab_size, width, dt, rngs)
        self.projection = param(rngs, (c.hidden_size, width), ("embed", None), dt)
        self.norm = RMSNorm(c.per_layer_input_size, c.norms.eps, dt, rngs, kind=c.norms.kind)
        self.layers, self.size, self.hidden = c.num_layers, c.per_layer_input_size, c.hidden_size

    def __call__(self,
                 tokens: jax.Array,  # [T] int32
                 x: jax.Array,  # [T, E] the scaled token embeddings
                 ) -> jax.Array:  # [T, L, P]
        shape = (x.shape[0], self.layers, self.size)
        token = (self.embed(tokens) * jnp.asarray(self.size ** 0.5, x.dtype)).reshape(shape)
        context = (x @ self.projection[...]) * jnp.asarray(self.hidden ** -0.5, x.dtype)
        context = self.norm(context.reshape(shape))
        return constrain((context + token) * jnp.asarray(2.0 ** -0.5, x.dtype), ("tokens", None, None))


class PerLayerBlock(nnx.Module):
    """One layer's use of its input: x + post_norm(act(x @ input_gate) * input @ proj)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c, dt, p = config, config.jnp_dtype, config.per_layer_input_size
        self.input_gate = param(rngs, (c.hidden_size, p), ("embed", None), dt)  # unquantized: P is narrow
        self.proj = param(rngs, (p, c.hidden_size), (None, "embed"), dt)
        self.norm = RMSNorm(c.hidden_size, c.norms.eps, dt, rngs, kind=c.norms.kind)
        self.activation = c.hidden_act

    def __call__(self,
                 x: jax.Array,  # [T, E]
                 inputs: jax.Array,  # [T, P] this layer's
                 ) -> jax.Array:  # [T, E]
        h = ACTIVATIONS[self.activation](x @ self.input_gate[...]) * inputs
        return x + self.norm(h @ self.proj[...])
