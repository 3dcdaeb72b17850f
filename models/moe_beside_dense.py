"""Gemma 4's feed-forward block: a dense MLP and a mixture of experts side by side on the
same input, each between its own norms, their sum handed to the layer's post-norm:

    dense_post_norm(mlp(dense_norm(x))) + experts_post_norm(moe(experts_norm(x)))

The router reads x itself (not the experts' normed input) through a weightless RMSNorm,
times a learned per-channel scale and 1/sqrt(hidden); softmax, top k, renormalised, and
each chosen expert's weight times its learned `expert_scale`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfill.models.config import ModelConfig
from jaxfill.models.layers import GatedMLP, RMSNorm, param, unit_rms
from jaxfill.models.moe import MoE


class ExpertsBesideDense(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c, dt, h = config, config.jnp_dtype, config.hidden_size

        def norm():
            return RMSNorm(h, c.norms.eps, dt, rngs, kind=c.norms.kind)

        self.dense_norm, self.dense_post_norm = norm(), norm()
        self.dense = GatedMLP(h, c.intermediate_size, dt, rngs, c.weight_form, c.hidden_act)
        self.experts_norm, self.experts_post_norm = norm(), norm()
        self.moe = MoE(c, rngs)
        # random-init scales (not ones) so tests would catch a port that skipped them
        self.router_scale = param(rngs, (h,), ("norm",), dt, init="one_plus_normal", scale=0.1)
        self.expert_scale = param(rngs, (c.moe.num_experts,), (None,), dt, init="one_plus_normal", scale=0.1)
        self.config, self.eps, self.hidden = c, c.norms.eps, h

    def __call__(self,
                 x: jax.Array,  # [T, H] the block's input (the residual stream)
                 valid: jax.Array | None = None,  # [T] bool: rows of real tokens
                 ) -> tuple[jax.Array, jax.Array]:  # [T, H], tokens routed to each expert [E] int32
        dense = self.dense_post_norm(self.dense(self.dense_norm(x)))
        router_input = unit_rms(x, self.eps) * self.router_scale[...] * jnp.asarray(self.hidden ** -0.5, x.dtype)
        routed, counts = self.moe(self.experts_norm(x), valid, router_input, self.expert_scale[...])
        return dense + self.experts_post_norm(routed), counts
