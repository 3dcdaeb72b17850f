"""LongCat-Flash's layer composition: a shortcut MoE carried from one layer to the next.

A LongCat-Flash layer holds two attention + dense-MLP blocks and one MoE; the MoE reads
the first block's MLP input and its output is added after the second block:

    x1 = x + attn0(n0(x));   h = m0(x1);   s = moe(h);   x2 = x1 + mlp0(h)
    x3 = x2 + attn1(n1(x2)); x4 = x3 + mlp1(m1(x3)) + s

Here each block is one of our layers (HF layer i = our layers 2i and 2i + 1, each with its
own latent cache entry), so the cache, the planner and the layer loop see ordinary
layers; what one layer hands the next is the residual stream and the shortcut s, side by
side as [T, 2, E] (zeros where no MoE has run yet). A layer with the MoE (an even one)
writes s; the next adds it and hands on zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfill.models.config import ModelConfig
from jaxfill.models.decoder import Decoder, token_rows
from jaxfill.models.layers import GatedMLP, RMSNorm
from jaxfill.models.mixers import MixerContext, build_mixer
from jaxfill.models.moe import MoE, is_moe_layer


class ShortcutLayer(nnx.Module):
    """One attention + dense-MLP block, pre-norm, and in a MoE layer the shortcut MoE."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, index: int = 0):
        c, dt = config, config.jnp_dtype
        self.attn_norm = RMSNorm(c.hidden_size, c.norms.eps, dt, rngs, kind=c.norms.kind)
        self.attn = build_mixer(c, rngs, index)
        self.mlp_norm = RMSNorm(c.hidden_size, c.norms.eps, dt, rngs, kind=c.norms.kind)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, dt, rngs, c.weight_form, c.hidden_act)
        self.moe = MoE(c, rngs) if is_moe_layer(c, index) else None

    def __call__(self,
                 stream: jax.Array,  # [T, 2, E]: the residual, the shortcut carried in
                 pages,  # this layer's latent pages
                 ctx: MixerContext,
                 ):  # ([T, 2, E] or [S, 2, E], pages, expert token counts [experts] int32 or None)
        x = stream[:, 0]
        h, pages = self.attn(self.attn_norm(x), pages, ctx)
        stream = ctx.sampled(stream)  # with sampled_only, only the sampled rows go on
        x, shortcut = stream[:, 0] + h, stream[:, 1]
        h = self.mlp_norm(x)
        if self.moe is None:  # the shortcut lands here, after this block's MLP
            out = x + self.mlp(h) + shortcut
            return jnp.stack([out, jnp.zeros_like(out)], axis=1), pages, None
        shortcut, counts = self.moe(h, token_rows(h, ctx))
        return jnp.stack([x + self.mlp(h), shortcut], axis=1), pages, counts


class ShortcutDecoder(Decoder):
    """The Decoder with ShortcutLayers and the shortcut beside the residual stream."""

    layer_class = ShortcutLayer

    def stream_in(self, x: jax.Array) -> jax.Array:  # [T, E] -> [T, 2, E]
        return jnp.stack([x, jnp.zeros_like(x)], axis=1)

    def stream_out(self, x: jax.Array) -> jax.Array:  # [S, 2, E] -> [S, E]; the last layer added its shortcut
        return x[:, 0]
