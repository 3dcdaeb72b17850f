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

import functools

import jax
import jax.numpy as jnp
from flax import nnx

import jaxfill.models.fp8_block as fp8_block
import jaxfill.models.int_group as int_group
from jaxfill.models.config import ModelConfig
from jaxfill.models.grouped_matmul import grouped_matmul
from jaxfill.models.layers import ACTIVATIONS, GatedMLP, param, projection
from jaxfill.models.lora import EXPERT_TABLE_AXES, grouped_delta
from jaxfill.models.parallel.expert import expert_parallel
from jaxfill.models.sharding import constrain


def route(logits: jax.Array,  # [T, E] f32 router logits
          config: ModelConfig,
          bias: jax.Array | None = None,  # [E] f32 correction bias (selection only)
          ) -> tuple[jax.Array, jax.Array]:  # weights [T, k] f32, expert ids [T, k] int32
    """Top-k routing. softmax: softmax over all experts, top k, optionally renormalised
    (Mixtral, Qwen3-MoE); with a selection bias, experts chosen on prob + bias and weighted
    by the plain probs (ERNIE 4.5). topk_softmax: top k of the logits, softmax over those k
    (gpt-oss). sparsemixer: two experts in turn (Phi-3.5-MoE, `sparsemixer`). sigmoid: sigmoid scores, experts chosen on score + bias within the best
    `router_topk_groups` of `router_groups` groups (a group scores the sum of its two
    best), weights from the plain scores, renormalised and times `routed_scaling`
    (DeepSeek-V3, GLM-4.5, MiniMax-M2; LFM2-MoE in one group, its sum + 1e-6). Softmax
    probabilities take the same groups (Mistral 4)."""
    c, k = config, config.moe.experts_per_token
    if c.moe.scoring == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
        if bias is None and c.moe.groups == 1:
            weights, ids = jax.lax.top_k(probs, k)
        else:
            _, ids = jax.lax.top_k(best_groups(probs if bias is None else probs + bias, c), k)
            weights = jnp.take_along_axis(probs, ids, axis=1)
    elif c.moe.scoring == "sparsemixer":
        weights, ids = sparsemixer(logits, c.moe.sparsemixer_eps)
    elif c.moe.scoring == "topk_softmax":
        top, ids = jax.lax.top_k(logits, k)
        weights = jax.nn.softmax(top, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
        _, ids = jax.lax.top_k(best_groups(scores if bias is None else scores + bias, c), k)
        weights = jnp.take_along_axis(scores, ids, axis=1)
    if c.moe.renormalize:
        eps = c.moe.renormalize_eps
        total = weights.sum(-1, keepdims=True) + (eps if eps is not None else 1e-20 if c.moe.scoring == "sigmoid"
                                                  else 0.0)
        if c.moe.renormalize_min:
            total = jnp.maximum(total, c.moe.renormalize_min)
        weights = weights / total
    return weights * c.moe.routed_scaling, ids.astype(jnp.int32)


def best_groups(choice: jax.Array,  # [T, E] f32 selection scores
                config: ModelConfig) -> jax.Array:  # [T, E]: -inf outside each row's best groups
    """The experts of the best `router_topk_groups` of `router_groups` groups (a group
    scores the sum of its two best); the scores as they are in one group."""
    g = config.moe.groups
    if g == 1:
        return choice
    t, e = choice.shape
    group_score = jax.lax.top_k(choice.reshape(t, g, e // g), 2)[0].sum(-1)  # [T, G]
    _, best = jax.lax.top_k(group_score, config.moe.topk_groups)
    keep = jnp.zeros_like(group_score, bool).at[jnp.arange(t)[:, None], best].set(True)
    return jnp.where(jnp.repeat(keep, e // g, axis=1), choice, -jnp.inf)


def sparsemixer(scores: jax.Array,  # [T, E] f32 router logits
                eps: float) -> tuple[jax.Array, jax.Array]:  # weights [T, 2] f32, ids [T, 2]
    """Phi-3.5-MoE's router at inference (transformers' `sparsemixer`, not training): the best
    expert, weighted by its share of a softmax over the experts whose logit is within
    2 * eps of the best's (relative to max(|logit|, best)); then the same over the experts
    left. The weights are not renormalised."""
    def pick(masked):  # masked: the scores, chosen experts at -inf
        best = jnp.max(masked, axis=-1, keepdims=True)
        ids = jnp.argmax(masked, axis=-1)
        far = (best - scores) / jnp.maximum(jnp.abs(scores), best) > 2 * eps
        gates = jax.nn.softmax(jnp.where(far, -jnp.inf, masked), axis=-1)
        return jnp.take_along_axis(gates, ids[:, None], axis=1), ids

    first_w, first = pick(scores)
    second_w, second = pick(jnp.where(jnp.arange(scores.shape[-1]) == first[:, None], -jnp.inf, scores))
    return jnp.concatenate([first_w, second_w], axis=-1), jnp.stack([first, second], axis=-1)


def gated(gate: jax.Array, up: jax.Array,  # [N, I] each
          activation: str, swiglu: tuple[float, float] | None = None,  # (limit, alpha)
          ) -> jax.Array:  # [N, I]
    """act(gate) * up; with `swiglu`, gpt-oss's clamped form
    (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    if swiglu is None:
        return ACTIVATIONS[activation](gate) * up
    limit, alpha = swiglu
    g = jnp.minimum(gate, limit)
    return (jnp.clip(up, -limit, limit) + 1) * (g * jax.nn.sigmoid(g * alpha))


def grouped_experts(x: jax.Array,  # [T, H]
                    weights: jax.Array,  # [T, k] f32
                    ids: jax.Array,  # [T, k] int32, global expert ids
                    params: dict,  # this rank's experts: gate_up [E_local, H, 2, I_local],
                    # down [E_local, I_local, H]; optional gate_up_scale [E_local, 2, I_local] and
                    # down_scale [E_local, H] f32 (int8 weights), gate_up_bias [E_local, 2, I_local]
                    # and down_bias [E_local, H]
                    first_expert,  # [] int32: the global id of local expert 0
                    activation: str,
                    lead=True,  # [] bool: this rank adds the down bias (one rank per tensor group)
                    impl: str = "auto",  # models/grouped_matmul.py
                    swiglu: tuple[float, float] | None = None,  # see `gated`
                    weights_inputs: bool = False,  # the weight scales the expert's input (Llama 4)
                    block: tuple[int, int] | None = None,  # fp8 weights: their scales' blocks
                    int_form: tuple[int, int] | None = None,  # int_group weights: (bits, group size)
                    slots: jax.Array | None = None,  # [T] i32 each token's LoRA slot; tables in params["lora_*"]
                    ) -> jax.Array:  # [T, H] f32: this rank's share of the MoE output
    """The pairs routed to the local experts, sorted by expert, through two grouped
    matmuls (models/grouped_matmul.py). Pairs of other ranks' experts sort last, past
    every group, and are dropped. fp8 experts are dequantized here, on this rank's
    share (its scales split with them: whole blocks, engine/validation.py)."""
    if fp8_block.is_fp8(params["gate_up"].dtype):
        weights_of = {name: fp8_block.dequantize(params[name], params[name + "_scale"],
                                                 fp8_block.LAYOUTS["experts_" + name], block, x.dtype)
                      for name in ("gate_up", "down")}
        params = {k: v for k, v in params.items() if k not in ("gate_up_scale", "down_scale")} | weights_of
    if int_form is not None:  # packed codes (models/int_group.py): this rank's experts and input groups
        bits, group = int_form
        weights_of = {name: int_group.dequantize(params[name], params[name + "_scale"], params.get(name + "_zero"),
                                                 None, 1, bits, group, x.dtype, stacked=1) for name in ("gate_up", "down")}
        params = {k: v for k, v in params.items() if not k.endswith(("_scale", "_zero"))} | weights_of
    gate_up, down = params["gate_up"], params["down"]
    t, k = ids.shape
    n_local, h, _, inter = gate_up.shape
    local_id = ids.reshape(-1) - first_expert  # [T*k]
    mine = (local_id >= 0) & (local_id < n_local)
    key = jnp.where(mine, local_id, n_local)
    order = jnp.argsort(key, stable=True)  # [T*k]
    sizes = jnp.bincount(key, length=n_local + 1)[:n_local].astype(jnp.int32)  # [E_local]
    token = order // k
    rows = jnp.take(x, token, axis=0)  # [T*k, H]
    pair_weights = jnp.take(weights.reshape(-1), order)[:, None]  # [T*k, 1] f32
    if weights_inputs:
        rows = (rows * pair_weights).astype(x.dtype)
        pair_weights = jnp.ones((), jnp.float32)
    expert_of_row = jnp.clip(jnp.take(key, order), 0, n_local - 1)

    def per_row(name, shape):  # the row's expert's entry of an optional [E_local, ...] param
        p = params.get(name)
        return None if p is None else jnp.take(p.reshape(n_local, shape), expert_of_row, axis=0)

    w1 = gate_up.reshape(n_local, h, 2 * inter)
    hid = grouped_matmul(rows, w1.astype(rows.dtype), sizes, impl)  # [T*k, 2I]
    lora = None
    if slots is not None:  # LoRA on the experts (models/lora.py): each pair's token's slot
        lora = functools.partial(grouped_delta, slots=jnp.take(slots, token),  # [T*k]
                                 sizes=sizes, matmul=functools.partial(grouped_matmul, impl=impl))
        hid = hid + lora(rows, params["lora_gate_up_a"], params["lora_gate_up_b"])
    if (scale := per_row("gate_up_scale", 2 * inter)) is not None:
        hid = (hid * scale).astype(rows.dtype)
    if (bias := per_row("gate_up_bias", 2 * inter)) is not None:
        hid = hid + bias.astype(hid.dtype)
    hid = gated(hid[:, :inter], hid[:, inter:], activation, swiglu)
    out = grouped_matmul(hid, down.astype(hid.dtype), sizes, impl)  # [T*k, H]
    if lora is not None:
        out = out + lora(hid, params["lora_down_a"], params["lora_down_b"])
    if (scale := per_row("down_scale", h)) is not None:
        out = (out * scale).astype(hid.dtype)
    if (bias := per_row("down_bias", h)) is not None:
        out = out + jnp.where(lead, bias, jnp.zeros((), bias.dtype)).astype(out.dtype)
    # Rows past the groups are 0 here but undefined in a grouped-matmul kernel: select, never multiply
    weighted = out.astype(jnp.float32) * pair_weights
    pairs = jnp.where(jnp.take(mine, order)[:, None], weighted, 0.0)
    return jnp.zeros((t, h), jnp.float32).at[token].add(pairs)


# The experts' stacked params and their logical axes (models/parallel/expert.py expert_parallel)
EXPERT_AXES = {
    "gate_up": ("experts", "embed", None, "moe_mlp"), "down": ("experts", "moe_mlp", "embed"),
    "gate_up_scale": ("experts", None, "moe_mlp"), "down_scale": ("experts", "embed"),
    "gate_up_bias": ("experts", None, "moe_mlp"), "down_bias": ("experts", "embed"),
}
# fp8 weights' block scales [E, in / B1, 2, out / B0] and [E, in / B1, out / B0] (models/fp8_block.py)
FP8_SCALE_AXES = {name + "_scale": fp8_block.scale_axes(EXPERT_AXES[name], fp8_block.LAYOUTS["experts_" + name])
                  for name in ("gate_up", "down")}


class MoE(nnx.Module):
    """Router, routed experts and (where the checkpoint has them) shared experts."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c, dt, wd = config, config.jnp_dtype, config.weight_form
        e, h, i = c.moe.num_experts, c.hidden_size, c.moe.intermediate_size
        self.config = c
        rdt = jnp.float32 if c.moe.router_f32 else dt
        self.router = param(rngs, (h, c.moe.router_width), ("embed", None), rdt)
        self.router_bias = (param(rngs, (c.moe.router_width,), (None,), jnp.float32, scale=0.1)
                            if c.moe.selection_bias else None)
        self.router_logit_bias = param(rngs, (e,), (None,), rdt, scale=0.1) if c.moe.router_logit_bias else None
        self.experts_gate_up, self.experts_gate_up_scale = projection(
            rngs, (e, h, 2, i), EXPERT_AXES["gate_up"], dt, 1, wd, stacked=1, name="experts_gate_up")
        self.experts_down, self.experts_down_scale = projection(
            rngs, (e, i, h), EXPERT_AXES["down"], dt, 1, wd, stacked=1, name="experts_down")
        if c.moe.expert_bias:
            self.experts_gate_up_bias = param(rngs, (e, 2, i), EXPERT_AXES["gate_up_bias"], dt, scale=0.1)
            self.experts_down_bias = param(rngs, (e, h), EXPERT_AXES["down_bias"], dt, scale=0.1)
        self.shared = (GatedMLP(h, c.moe.shared_expert_size, dt, rngs, wd, c.hidden_act)
                       if c.moe.shared_expert_size else None)
        self.shared_gate = param(rngs, (h, 1), ("embed", None), dt) if c.moe.shared_expert_gate else None

    def __call__(self,
                 x: jax.Array,  # [T, H]
                 valid: jax.Array | None = None,  # [T] bool: rows of real tokens (None: all)
                 router_input: jax.Array | None = None,  # [T, H] what the router reads (None: x)
                 expert_scale: jax.Array | None = None,  # [E] each expert's weights times this (Gemma 4)
                 lora_slots: jax.Array | None = None,  # [T] i32 each row's LoRA slot (models/lora.py)
                 ) -> tuple[jax.Array, jax.Array]:  # [T, H], tokens routed to each expert [E] int32
        """The layer's output, and how many (valid token, expert) pairs each expert got in
        this call: the load statistics the engine accumulates (engine/expert_load.py)."""
        c = self.config
        with jax.named_scope("moe"):
            xr = x if router_input is None else router_input
            xr = xr.astype(jnp.float32) if c.moe.router_f32 else xr
            logits = jnp.einsum("th,he->te", xr, self.router[...])  # [T, experts]
            if self.router_logit_bias is not None:
                logits = logits + self.router_logit_bias[...]
            weights, ids = route(logits.astype(jnp.float32), c, _value(self.router_bias))
            if expert_scale is not None:
                weights = weights * jnp.take(expert_scale.astype(jnp.float32), ids)
            swiglu = None if c.moe.swiglu_limit is None else (c.moe.swiglu_limit, c.moe.swiglu_alpha)

            block = c.weight_form.block if c.weight_dtype == "fp8_block" else None
            int_form = (c.weight_bits, c.weight_group_size) if c.weight_dtype == "int_group" else None

            def local(x, weights, ids, params, first_expert, lead, slots=None):
                return grouped_experts(x, weights, ids, params, first_expert, c.hidden_act, lead, swiglu=swiglu,
                                       weights_inputs=c.moe.weights_inputs, block=block, int_form=int_form,
                                       slots=slots)

            params = {name: _value(getattr(self, "experts_" + name, None)) for name in EXPERT_AXES
                      if not (int_form and name.endswith("_scale"))}
            axes = {**EXPERT_AXES, **FP8_SCALE_AXES} if block else EXPERT_AXES
            if int_form:  # each IntGroupScales' arrays, split like its params
                for name in ("gate_up", "down"):
                    scales = getattr(self, f"experts_{name}_scale")
                    params |= {name + "_scale": scales.scale[...]}
                    params |= {name + "_zero": scales.zero[...]} if scales.zero is not None else {}
                    both = int_group.scale_axes(EXPERT_AXES[name], 1, c.weight_form, stacked=1)
                    axes = {**axes, name + "_scale": both, name + "_zero": both}
            if lora_slots is not None:  # the experts' LoRA tables (models/lora.py ExpertLoraTables)
                params |= self.lora.params()
                axes = {**axes, **EXPERT_TABLE_AXES}
            # a zero-compute expert's id is past every rank's experts, so no rank dispatches it
            out = expert_parallel(local, x, weights, ids, params, axes, lora_slots)
            if c.moe.zero_experts:
                out = out + identity_experts(x, weights, ids, c.moe.num_experts)
            out = constrain(out.astype(x.dtype), ("tokens", "act_embed"))
            if self.shared is not None:
                shared = self.shared(x)
                if self.shared_gate is not None:
                    gate = jax.nn.sigmoid(jnp.einsum("th,ho->to", x, self.shared_gate[...]))
                    shared = shared * gate
                out = out + shared
            return out, expert_token_counts(ids, valid, c.moe.num_experts)


def identity_experts(x: jax.Array,  # [T, H]
                     weights: jax.Array,  # [T, k] f32
                     ids: jax.Array,  # [T, k] int32
                     num_experts: int) -> jax.Array:  # [T, H] f32
    """The zero-compute experts' share (LongCat-Flash): each returns its token, so their
    output is the token times the weights routed to ids >= num_experts. They hold no
    weights and run where the token is, before any dispatch (replicated under mesh.expert)."""
    identity = jnp.where(ids >= num_experts, weights, 0.0).sum(-1, keepdims=True)  # [T, 1]
    return x.astype(jnp.float32) * identity


def expert_token_counts(ids: jax.Array,  # [T, k] int32
                        valid: jax.Array | None,  # [T] bool, or None (every row counts)
                        num_experts: int) -> jax.Array:  # [E] int32
    """Valid (token, expert) pairs per expert: a scatter-add of T*k ones, never [T, k, E]."""
    ones = jnp.ones(ids.shape, jnp.int32) if valid is None else jnp.broadcast_to(
        valid[:, None], ids.shape).astype(jnp.int32)
    # zero-compute experts' ids (>= num_experts) are dropped: they run no expert
    return jnp.zeros((num_experts,), jnp.int32).at[ids.reshape(-1)].add(ones.reshape(-1), mode="drop")


def _value(p):
    return None if p is None else p[...]


def is_moe_layer(config: ModelConfig, layer: int) -> bool:
    """A layer whose MLP is the mixture of experts (not a dense layer, nor one without an MLP)."""
    return config.moe.num_experts > 0 and layer not in config.moe.dense_layers and layer not in config.no_mlp_layers

