"""GLM-4.5 / 4.6 (Glm4MoeForCausalLM): the first `first_k_dense_replace` layers dense,
then sigmoid-routed experts (a correction bias, grouped top-k, renormalised, times
`routed_scaling_factor`; the router in f32) beside `n_shared_experts` shared experts;
attention with q/k/v biases, optional q/k norms and rope over part of each head."""

from __future__ import annotations

from jaxfill.models.families.base import Family, activation
from jaxfill.models.families.experts import grouped_sigmoid_moe_tensors
from jaxfill.models.families.mtp_tensors import skipped_mtp_prefixes
from jaxfill.models.moe import is_moe_layer


class Glm4Moe(Family):
    name = "glm4_moe"
    architectures = ("Glm4MoeForCausalLM",)
    honoured = frozenset({"hidden_act", "attention_bias", "moe_intermediate_size", "num_experts_per_tok",
                          "n_shared_experts", "n_routed_experts", "num_local_experts", "routed_scaling_factor",
                          "n_group", "topk_group", "first_k_dense_replace", "norm_topk_prob", "use_qk_norm",
                          "partial_rotary_factor"})
    # training only; num_nextn_predict_layers changes no number of the target (model_fields reads
    # it into mtp_layers: the proposer of speculative.method = "mtp", models/mtp.py)
    inert = frozenset({"router_aux_loss_coef", "output_router_logits", "num_mtp_layers",
                       "num_nextn_predict_layers"})
    partial_rotary = True
    experts = True
    tested = ("HF f32 logits and greedy tokens (sigmoid grouped routing with its bias, shared experts, partial "
              "rotary, a dense first layer); through the Engine prefix-cached = expert 4 = expert 2 x tensor 2")

    def model_fields(self, hf):
        layers, head_dim = hf["num_hidden_layers"], hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        rope = hf.get("rope_parameters") or {}
        partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))
        experts = int(hf.get("n_routed_experts", hf.get("num_local_experts")))
        bias = bool(hf.get("attention_bias", False))
        shared = int(hf.get("n_shared_experts") or 0) * hf["moe_intermediate_size"]
        return dict(hidden_act=activation(hf), attention_bias=bias, attention_out_bias=False,
                    qk_norm="head" if hf.get("use_qk_norm") else "none", rotary_dim=int(head_dim * partial),
                    num_experts=experts, experts_per_token=hf["num_experts_per_tok"],
                    moe_intermediate_size=hf["moe_intermediate_size"],
                    dense_layers=tuple(range(min(int(hf.get("first_k_dense_replace", 1)), layers))),
                    router_scoring="sigmoid", router_bias=True, router_f32=True,
                    router_renormalize=bool(hf.get("norm_topk_prob", True)),
                    router_groups=int(hf.get("n_group") or 1), router_topk_groups=int(hf.get("topk_group") or 1),
                    routed_scaling=float(hf.get("routed_scaling_factor", 1.0)), shared_expert_size=shared,
                    mtp_layers=int(hf.get("num_nextn_predict_layers") or hf.get("num_mtp_layers") or 0))

    def model_defaults(self, hidden_size):
        return dict(attention_bias=True, rotary_dim=0, num_experts=8, experts_per_token=2,
                    moe_intermediate_size=hidden_size, router_scoring="sigmoid", router_bias=True, router_f32=True,
                    shared_expert_size=hidden_size, dense_layers=(0,))

    def skipped_prefixes(self, config, hf):
        """GLM-4.5 stores its multi-token-prediction layer as model.layers.{num_hidden_layers}.*
        (DeepSeek-V3's layout): loaded only to propose (models/families/mtp_tensors.py)."""
        n = int(hf.get("num_nextn_predict_layers") or hf.get("num_mtp_layers") or 0)
        return self.ignored_prefixes + skipped_mtp_prefixes(config, n)

    def mlp_tensors(self, c, p, layer):
        if not is_moe_layer(c, layer[1]):
            return super().mlp_tensors(c, p, layer)
        return grouped_sigmoid_moe_tensors(c, p, layer)


FAMILIES = (Glm4Moe(),)
