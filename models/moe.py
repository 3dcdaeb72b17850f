"""Dropless mixture of experts: route, sort the (token, expert) pairs by expert, one
grouped matmul per projection (models/grouped_matmul.py, gate and up fused), weighted combine.

No capacity factor and no dropped token: every pair is computed. The experts' params are
stacked [E, ...] with the logical axis 'experts' (models/sharding.py splits it over
'expert'); their intermediate axis 'moe_mlp' splits over 'tensor'. Tokens reach the MoE
replicated over both axes (attention and the dense layers split over tensor x expert and
end in an all-reduce), so dispatch is local: each rank takes the pairs routed to its own
experts, runs its slice of them, and one all-reduce over (expert, tensor) sums the
partial outputs, the same bytes as a dense MLP's all-reduce (`expert_parallel`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfill.models.config import ModelConfig
from jaxfill.models.grouped_matmul import grouped_matmul
from jaxfill.models.layers import ACTIVATIONS, GatedMLP, param, projection
from jaxfill.models.sharding import constrain, expert_parallel


def route(logits: jax.Array,  # [T, E] f32 router logits
          config: ModelConfig,
          bias: jax.Array | None = None,  # [E] f32 correction bias (sigmoid routers), selection only
          ) -> tuple[jax.Array, jax.Array]:  # weights [T, k] f32, expert ids [T, k] int32
    """Top-k routing. softmax: softmax over all experts, top k, optionally renormalised
    (Mixtral, Qwen3-MoE). sigmoid: sigmoid scores, experts chosen on score + bias within the
    best `router_topk_groups` of `router_groups` groups (a group scores the sum of its two
    best), weights from the plain scores, renormalised and times `routed_scaling`
    (DeepSeek-V3, GLM-4.5)."""
    c, k = config, config.experts_per_token
    if c.router_scoring == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
        weights, ids = jax.lax.top_k(probs, k)
    else:
        scores = jax.nn.sigmoid(logits)
        choice = scores if bias is None else scores + bias
        if c.router_groups > 1:
            t, e = choice.shape
            grouped = choice.reshape(t, c.router_groups, e // c.router_groups)
            group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [T, G]
            _, best = jax.lax.top_k(group_score, c.router_topk_groups)
            keep = jnp.zeros_like(group_score, bool).at[jnp.arange(t)[:, None], best].set(True)
            choice = jnp.where(jnp.repeat(keep, e // c.router_groups, axis=1), choice, -jnp.inf)
        _, ids = jax.lax.top_k(choice, k)
        weights = jnp.take_along_axis(scores, ids, axis=1)
    if c.router_renormalize:
        weights = weights / (weights.sum(-1, keepdims=True) + (1e-20 if c.router_scoring == "sigmoid" else 0.0))
    return weights * c.routed_scaling, ids.astype(jnp.int32)


def grouped_experts(x: jax.Array,  # [T, H]
                    weights: jax.Array,  # [T, k] f32
                    ids: jax.Array,  # [T, k] int32, global expert ids
                    gate_up: jax.Array,  # [E_local, H, 2, I_local]
                    down: jax.Array,  # [E_local, I_local, H]
                    first_expert,  # [] int32: the global id of local expert 0
                    activation: str,
                    gate_up_scale=None,  # [E_local, 2, I_local] f32 (int8 weights)
                    down_scale=None,  # [E_local, H] f32
                    impl: str = "auto",  # models/grouped_matmul.py
                    ) -> jax.Array:  # [T, H] f32: this rank's share of the MoE output
    """The pairs routed to the local experts, sorted by expert, through two grouped
    matmuls (models/grouped_matmul.py). Pairs of other ranks' experts sort last, past
    every group, and are dropped."""
    t, k = ids.shape
    n_local, h, _, inter = gate_up.shape
    local_id = ids.reshape(-1) - first_expert  # [T*k]
    mine = (local_id >= 0) & (local_id < n_local)
    key = jnp.where(mine, local_id, n_local)
    order = jnp.argsort(key, stable=True)  # [T*k]
    sizes = jnp.bincount(key, length=n_local + 1)[:n_local].astype(jnp.int32)  # [E_local]
    token = order // k
    rows = jnp.take(x, token, axis=0)  # [T*k, H]
    expert_of_row = jnp.clip(jnp.take(key, order), 0, n_local - 1)
    w1 = gate_up.reshape(n_local, h, 2 * inter)
    hid = grouped_matmul(rows, w1.astype(rows.dtype), sizes, impl)  # [T*k, 2I]
    if gate_up_scale is not None:
        hid = (hid * jnp.take(gate_up_scale.reshape(n_local, 2 * inter), expert_of_row, axis=0)).astype(rows.dtype)
    hid = ACTIVATIONS[activation](hid[:, :inter]) * hid[:, inter:]
    out = grouped_matmul(hid, down.astype(hid.dtype), sizes, impl)  # [T*k, H]
    if down_scale is not None:
        out = (out * jnp.take(down_scale, expert_of_row, axis=0)).astype(hid.dtype)
    # Rows past the groups are 0 here but undefined in a grouped-matmul kernel: select, never multiply
    weighted = out.astype(jnp.float32) * jnp.take(weights.reshape(-1), order)[:, None]
    pairs = jnp.where(jnp.take(mine, order)[:, None], weighted, 0.0)
    return jnp.zeros((t, h), jnp.float32).at[token].add(pairs)


class MoE(nnx.Module):
    """Router, routed experts and (where the checkpoint has them) shared experts."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c, dt, wd = config, config.jnp_dtype, config.weight_dtype
        e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
        self.config = c
        self.router = param(rngs, (h, e), ("embed", None), jnp.float32 if c.router_f32 else dt)
        self.router_bias = (param(rngs, (e,), (None,), jnp.float32, scale=0.1)
                            if c.router_bias else None)
        self.experts_gate_up, self.experts_gate_up_scale = projection(
            rngs, (e, h, 2, i), ("experts", "embed", None, "moe_mlp"), dt, 1, wd, stacked=1)
        self.experts_down, self.experts_down_scale = projection(
            rngs, (e, i, h), ("experts", "moe_mlp", "embed"), dt, 1, wd, stacked=1)
        self.shared = (GatedMLP(h, c.shared_expert_size, dt, rngs, wd, c.hidden_act)
                       if c.shared_expert_size else None)
        self.shared_gate = param(rngs, (h, 1), ("embed", None), dt) if c.shared_expert_gate else None

    def __call__(self, x: jax.Array) -> jax.Array:  # [T, E] -> [T, E]
        with jax.named_scope("moe"):
            xr = x.astype(jnp.float32) if self.config.router_f32 else x
            logits = jnp.einsum("th,he->te", xr, self.router[...]).astype(jnp.float32)  # [T, experts]
            bias = None if self.router_bias is None else self.router_bias[...]
            weights, ids = route(logits, self.config, bias)
            act = self.config.hidden_act

            def local(x, weights, ids, gate_up, down, gate_up_scale, down_scale, first_expert):
                return grouped_experts(x, weights, ids, gate_up, down, first_expert, act,
                                       gate_up_scale, down_scale)

            scales = (_value(self.experts_gate_up_scale), _value(self.experts_down_scale))
            out = expert_parallel(local, x, weights, ids, self.experts_gate_up[...], self.experts_down[...],
                                  *scales)
            out = constrain(out.astype(x.dtype), ("tokens", "act_embed"))
            if self.shared is not None:
                shared = self.shared(x)
                if self.shared_gate is not None:
                    gate = jax.nn.sigmoid(jnp.einsum("th,ho->to", x, self.shared_gate[...]))
                    shared = shared * gate
                out = out + shared
            return out


def _value(p):
    return None if p is None else p[...]


def is_moe_layer(config: ModelConfig, layer: int) -> bool:
    return config.num_experts > 0 and layer not in config.dense_layers

