"""Hunyuan (HunYuanDenseV1ForCausalLM, HunYuanMoEV1ForCausalLM): Llama's layer with
per-head q/k RMSNorms applied after rope (`query_layernorm`, `key_layernorm`); rope of the
checkpoints' "dynamic" type with a fixed `alpha` (NTK-alpha: the base stretched to
theta * alpha ** (D / (D - 2)), the same at every length) or linear. The MoE: every MLP a
softmax top-k router in f32, renormalised, beside a shared MLP of `intermediate_size`
(the experts' size too). Per-layer expert counts (lists) are read when every layer agrees."""

from __future__ import annotations

from jaxfill.models.config import ConfigError
from jaxfill.models.families.base import Family, activation
from jaxfill.models.families.experts import expert_tensors, shared_expert_tensors

TESTED_MOE = ("HF f32 logits and greedy tokens (q/k norms after rope, NTK-alpha rope, softmax routing in f32 "
              "beside a shared MLP)"
              "; through the Engine prefix-cached = expert 4 = expert 2 x tensor 2")


def same_for_every_layer(hf, key: str) -> int:
    value = hf.get(key)
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ConfigError(f"config.json {key}={value!r}: per-layer values that differ are not supported")
        value = value[0]
    if not value:
        raise ConfigError(f"config.json has no {key}")
    return int(value)


class HunYuanDense(Family):
    name = "hunyuan_v1_dense"
    architectures = ("HunYuanDenseV1ForCausalLM",)
    honoured = frozenset({"hidden_act", "attention_bias"})
    # eod_token_id: an end-of-document id generation does not stop on; pretraining_tp: unused by the forward
    inert = frozenset({"eod_token_id", "pretraining_tp"})
    rope_types = ("default", "linear")
    tested = ("HF f32 logits and greedy tokens, bf16 at the noise floor (q/k norms after rope, NTK-alpha rope); "
              "through the Engine chunked = prefix-cached = tensor 2 = sequence 2 = scan = stage 2; int8 weights + "
              "int8 KV run")

    def model_fields(self, hf):
        bias = bool(hf.get("attention_bias", False))
        return dict(self.model_defaults(hf["hidden_size"]), hidden_act=activation(hf), attention_bias=bias,
                    attention_out_bias=bias)

    def model_defaults(self, hidden_size):
        return dict(qk_norm="head", qk_norm_after_rope=True)

    def rope(self, hf, rope=None):
        """The checkpoints' "dynamic" rope with an `alpha` is NTK-alpha, a fixed base."""
        params = rope if rope is not None else (hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        kind = params.get("rope_type", params.get("type"))
        if kind == "dynamic" and params.get("alpha"):
            d = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
            theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
            return theta * float(params["alpha"]) ** (d / (d - 2)), None
        return super().rope(hf, rope)

    def layer_tensors(self, c, p, layer):
        table = super().layer_tensors(c, p, layer)
        for ours, theirs in (("q_norm", "query_layernorm"), ("k_norm", "key_layernorm")):
            table[f"{p}self_attn.{theirs}.weight"] = table.pop(f"{p}self_attn.{ours}.weight")
        return table


class HunYuanMoE(HunYuanDense):
    name = "hunyuan_v1_moe"
    architectures = ("HunYuanMoEV1ForCausalLM",)
    honoured = HunYuanDense.honoured | {"num_experts", "num_local_experts", "moe_topk", "num_experts_per_tok"}
    inert = HunYuanDense.inert | {"output_router_logits"}
    experts = True
    tested = TESTED_MOE

    def model_fields(self, hf):
        i = hf["intermediate_size"]
        return dict(super().model_fields(hf), num_experts=same_for_every_layer(hf, "num_experts"),
                    experts_per_token=same_for_every_layer(hf, "moe_topk"), moe_intermediate_size=i,
                    shared_expert_size=i, router_f32=True, router_renormalize=True)

    def model_defaults(self, hidden_size):
        return dict(super().model_defaults(hidden_size), num_experts=8, experts_per_token=2,
                    moe_intermediate_size=4 * hidden_size, shared_expert_size=4 * hidden_size, router_f32=True)

    def mlp_tensors(self, c, p, layer):
        table = expert_tensors(c, p, layer, router="gate.wg")
        table.update(shared_expert_tensors(c, p, layer, name="shared_mlp", gate=None))
        return table


FAMILIES = (HunYuanDense(), HunYuanMoE())
