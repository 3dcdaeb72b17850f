"""Qwen3-Next: Qwen3.5's hybrid stack (Gated DeltaNet x3, gated full attention) with
Qwen2-MoE's sparse MLP (softmax top-k routed experts beside a sigmoid-gated shared
expert). Its DeltaNet projections are fused per key head: `in_proj_qkvz` holds
[q, k, v, z] of each key head's group and `in_proj_ba` its [b, a]
(`linear_grouped_proj`; models/mixers/gated_deltanet.py splits them)."""

from __future__ import annotations

from jaxfill.models.families.base import HFTensor
from jaxfill.models.families.experts import expert_tensors, shared_expert_tensors
from jaxfill.models.families.qwen3_5 import Qwen3_5
from jaxfill.models.families.qwen3_moe import SPARSE_FIELDS, TRAINING_ONLY, dense_layers, experts_of
from jaxfill.models.moe import is_moe_layer


class Qwen3Next(Qwen3_5):
    name = "qwen3_next"
    architectures = ("Qwen3NextForCausalLM",)
    experts = True
    honoured = Qwen3_5.honoured | SPARSE_FIELDS | {"shared_expert_intermediate_size"}
    inert = TRAINING_ONLY | Qwen3_5.inert
    tested = ("HF f32 logits and greedy tokens (model level); through the Engine: prefix-cached = uncached "
              "with state snapshots")

    def model_fields(self, hf):
        fields = super().model_fields(hf)
        shared = int(hf.get("shared_expert_intermediate_size") or 0)
        fields.update(linear_grouped_proj=True, num_experts=experts_of(hf), experts_per_token=hf["num_experts_per_tok"],
                      moe_intermediate_size=hf["moe_intermediate_size"],
                      router_renormalize=bool(hf.get("norm_topk_prob", True)),
                      dense_layers=dense_layers(hf, hf["num_hidden_layers"]),
                      shared_expert_size=shared, shared_expert_gate=bool(shared))
        return fields

    def model_defaults(self, hidden_size):
        return dict(super().model_defaults(hidden_size), linear_grouped_proj=True, num_experts=8, experts_per_token=2,
                    moe_intermediate_size=hidden_size, router_renormalize=True, shared_expert_size=hidden_size,
                    shared_expert_gate=True)

    def layer_tensors(self, c, p, layer):
        table = super().layer_tensors(c, p, layer)
        if layer[1] not in c.linear.layers:
            return table
        la, a = p + "linear_attn.", layer + ("attn",)
        for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
            del table[la + name + ".weight"]
        e, hk, hv, dk, dv = (c.hidden_size, c.linear.num_key_heads, c.linear.num_value_heads, c.linear.key_head_dim,
                             c.linear.value_head_dim)
        w, r = 2 * dk + 2 * hv // hk * dv, hv // hk
        table[la + "in_proj_qkvz.weight"] = HFTensor(a + ("qkvz",), (hk * w, e), (hk, w, e), (2, 0, 1))
        table[la + "in_proj_ba.weight"] = HFTensor(a + ("ba",), (hk * 2 * r, e), (hk, 2 * r, e), (2, 0, 1))
        return table

    def mlp_tensors(self, c, p, layer):
        if not is_moe_layer(c, layer[1]):
            return super().mlp_tensors(c, p, layer)
        table = expert_tensors(c, p, layer)
        if c.moe.shared_expert_size:
            table.update(shared_expert_tensors(c, p, layer))
        return table


FAMILIES = (Qwen3Next(),)
