"""Qwen3-MoE (Qwen3's attention, sparse MLPs) and Qwen2-MoE (Qwen2's attention, a gated
shared expert beside the routed ones). A layer is sparse unless `mlp_only_layers` names
it or (layer + 1) is not a multiple of `decoder_sparse_step`; the others keep the dense
MLP of `intermediate_size`."""

from __future__ import annotations

from jaxfill.models.config import ConfigError
from jaxfill.models.families.base import (
    SLIDING_DEPENDS, Family, activation, layer_types_from, sliding_layers, window_fields,
)
from jaxfill.models.families.experts import expert_tensors, shared_expert_tensors
from jaxfill.models.moe import is_moe_layer

SPARSE_FIELDS = frozenset({"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                           "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"})
TRAINING_ONLY = frozenset({"router_aux_loss_coef", "output_router_logits"})


def experts_of(hf) -> int:
    n = hf.get("num_experts", hf.get("num_local_experts"))
    if not n:
        raise ConfigError("config.json has no num_experts (num_local_experts)")
    return int(n)


def dense_layers(hf, num_layers: int) -> tuple[int, ...]:
    only = set(hf.get("mlp_only_layers") or ())
    step = int(hf.get("decoder_sparse_step") or 1)
    return tuple(n for n in range(num_layers) if n in only or (n + 1) % step)


class Qwen3Moe(Family):
    name = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)
    honoured = SPARSE_FIELDS | {"hidden_act", "attention_bias", "use_sliding_window", "sliding_window",
                                "max_window_layers", "layer_types"}
    inert = TRAINING_ONLY
    depends = SLIDING_DEPENDS
    experts = True
    tested = ("HF f32 logits and greedy tokens; through the Engine prefix-cached = expert 4 = "
              "expert 2 x tensor 2 = one device (a dense layer between sparse ones)")

    def model_fields(self, hf):
        layers, bias = hf["num_hidden_layers"], bool(hf.get("attention_bias", False))
        return dict(self.model_defaults(hf["hidden_size"]), hidden_act=activation(hf),
                    attention_bias=bias, attention_out_bias=bias,
                    num_experts=experts_of(hf), experts_per_token=hf["num_experts_per_tok"],
                    moe_intermediate_size=hf["moe_intermediate_size"],
                    router_renormalize=bool(hf.get("norm_topk_prob", False)),
                    dense_layers=dense_layers(hf, layers),
                    **window_fields(sliding_layers(hf, layers), hf.get("sliding_window")))

    def model_defaults(self, hidden_size):
        return dict(qk_norm="head", num_experts=8, experts_per_token=2, moe_intermediate_size=hidden_size)

    def mlp_tensors(self, c, p, layer):
        if not is_moe_layer(c, layer[1]):
            return super().mlp_tensors(c, p, layer)
        return expert_tensors(c, p, layer)


class Qwen2Moe(Qwen3Moe):
    name = "qwen2_moe"
    architectures = ("Qwen2MoeForCausalLM",)
    honoured = Qwen3Moe.honoured - {"attention_bias"} | {"shared_expert_intermediate_size", "qkv_bias"}
    tested = "HF f32 logits and greedy tokens (gated shared expert)"
    depends = {**SLIDING_DEPENDS, "max_window_layers": {"use_sliding_window": True, "sliding_window": 16,
                                                        "max_window_layers": 2}}

    def model_fields(self, hf):
        fields = super().model_fields(hf)
        layers = hf["num_hidden_layers"]
        types = layer_types_from(hf, layers) or (tuple(  # its own rule: even layers below max_window_layers
            "sliding" if n % 2 == 0 and n < hf.get("max_window_layers", layers) else "full" for n in range(layers))
            if hf.get("use_sliding_window") else ())
        fields.update(window_fields(types, hf.get("sliding_window")))
        fields.update(attention_bias=bool(hf.get("qkv_bias", True)), attention_out_bias=False,
                      shared_expert_size=int(hf.get("shared_expert_intermediate_size") or 0),
                      shared_expert_gate=bool(hf.get("shared_expert_intermediate_size")))
        return fields

    def model_defaults(self, hidden_size):
        return dict(attention_bias=True, num_experts=8, experts_per_token=2, moe_intermediate_size=hidden_size,
                    shared_expert_size=2 * hidden_size, shared_expert_gate=True)

    def mlp_tensors(self, c, p, layer):
        table = super().mlp_tensors(c, p, layer)
        if is_moe_layer(c, layer[1]) and c.moe.shared_expert_size:
            table.update(shared_expert_tensors(c, p, layer))
        return table


FAMILIES = (Qwen3Moe(), Qwen2Moe())
