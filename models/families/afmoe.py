"""AFMoE (AfmoeForCausalLM: Arcee Trinity).

Sliding-window and global layers (every `global_attn_every_n_layers`-th global, unless
`layer_types` spells them out); rope turns only on the sliding layers, the global ones are
NoPE. Every layer RMS-norms q and k per head before rope and gates its output by
sigmoid(x @ gate_proj), a projection of its own ([Hq * D, E], elementwise over each head's
dims). Norms sit before and after both blocks (weight times the f32 normed value, then
cast: "rms_f32"). The first `num_dense_layers` MLPs are dense; the rest route each token
to the top k of sigmoid scores plus `expert_bias` (selection only), weights the plain
scores renormalised (+ 1e-20) times `route_scale`, beside a shared MLP of
`num_shared_experts` x moe_intermediate_size. `mup_enabled` scales the embeddings by
sqrt(hidden_size)."""

from __future__ import annotations

from jaxfill.models.config import ConfigError
from jaxfill.models.families.base import HFTensor, Family, activation, layer_types_from, window_fields
from jaxfill.models.families.experts import expert_tensors, shared_expert_tensors
from jaxfill.models.moe import is_moe_layer

TESTED = ("HF f32 logits and greedy tokens (24-token windows on the roped sliding layers, NoPE global layers, "
          "q/k norms, the output gate, sandwich norms, muP embeddings, a dense first layer, sigmoid routing with "
          "its selection bias and route_scale beside shared experts); through the Engine chunked = prefix-cached "
          "= expert 4 = expert 2 x tensor 2 = expert 2 x sequence 2")


def afmoe_layer_types(hf, layers: int) -> tuple[str, ...]:
    """transformers' default: layer n global where (n + 1) % global_attn_every_n_layers == 0."""
    types = layer_types_from(hf, layers)
    if types:
        return types
    every = hf.get("global_attn_every_n_layers", 4)
    if not every or every < 1:
        raise ConfigError(f"config.json global_attn_every_n_layers={every!r} must be a positive layer count")
    return tuple("full" if (n + 1) % every == 0 else "sliding" for n in range(layers))


class Afmoe(Family):
    name = "afmoe"
    architectures = ("AfmoeForCausalLM",)
    honoured = frozenset({"hidden_act", "attention_bias", "layer_types", "global_attn_every_n_layers",
                          "sliding_window", "mup_enabled", "num_dense_layers", "num_experts", "num_experts_per_tok",
                          "num_shared_experts", "moe_intermediate_size", "route_scale"})
    inert = frozenset({"output_router_logits"})  # training only
    experts = True
    tested = TESTED
    norm_names = {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
                  "mlp_norm": "pre_mlp_layernorm", "mlp_post_norm": "post_mlp_layernorm"}

    def model_fields(self, hf):
        layers = hf["num_hidden_layers"]
        types = afmoe_layer_types(hf, layers)
        experts = int(hf.get("num_experts") or 0)
        if not experts:
            raise ConfigError("config.json num_experts of afmoe must be positive (its sparse layers route to them)")
        bias = bool(hf.get("attention_bias", False))
        inter = int(hf["moe_intermediate_size"])
        return dict(
            self.model_defaults(hf["hidden_size"]), hidden_act=activation(hf),
            attention_bias=bias, attention_out_bias=bias,
            nope_layers=tuple(n for n, t in enumerate(types) if t == "full"),
            embed_scale=float(hf["hidden_size"]) ** 0.5 if hf.get("mup_enabled") else 1.0,
            num_experts=experts, experts_per_token=int(hf["num_experts_per_tok"]), moe_intermediate_size=inter,
            dense_layers=tuple(range(min(int(hf.get("num_dense_layers") or 0), layers))),
            routed_scaling=float(hf.get("route_scale") or 1.0),
            shared_expert_size=int(hf.get("num_shared_experts") or 0) * inter,
            **window_fields(types, hf.get("sliding_window")))

    def model_defaults(self, hidden_size):
        return dict(qk_norm="head", attn_gate_proj=True, norm_kind="rms_f32", norm_layout="sandwich",
                    router_scoring="sigmoid", router_bias=True, router_renormalize=True, num_experts=8,
                    experts_per_token=2, moe_intermediate_size=hidden_size, shared_expert_size=hidden_size,
                    dense_layers=(0,))

    def attention_tensors(self, c, p, layer):
        e, d, hq = c.hidden_size, c.head_dim, c.num_heads
        table = super().attention_tensors(c, p, layer)
        table[p + "self_attn.gate_proj.weight"] = HFTensor(layer + ("attn", "gate"), (hq * d, e), (hq, d, e),
                                                           (2, 0, 1))
        return table

    def mlp_tensors(self, c, p, layer):
        if not is_moe_layer(c, layer[1]):
            return super().mlp_tensors(c, p, layer)
        n = c.moe.num_experts
        table = expert_tensors(c, p, layer, router="router.gate")
        table[p + "mlp.expert_bias"] = HFTensor(layer + ("mlp", "router_bias"), (n,), (n,), (0,))
        if c.moe.shared_expert_size:
            table.update(shared_expert_tensors(c, p, layer, name="shared_experts", gate=None))
        return table


FAMILIES = (Afmoe(),)
