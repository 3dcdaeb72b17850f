"""LFM2-MoE (Lfm2MoeForCausalLM): LFM2's stack (attention with per-head q/k norms, gated
short convolutions) whose first `num_dense_layers` MLPs are dense SwiGLU of
intermediate_size (no width adjustment, unlike LFM2) and the rest mixtures of experts:
sigmoid scores, the top k chosen on score + `expert_bias` (`use_expert_bias`), weighted by
the plain scores, renormalised (`norm_topk_prob`) as w / (sum + 1e-6), times
`routed_scaling_factor`. Experts are read per expert (`experts.{j}.w1` gate, `w3` up, `w2`
down: what save_pretrained writes); `layer_types` must be given (transformers builds no
default)."""

from __future__ import annotations

from jaxfill.models.families.experts import expert_tensors
from jaxfill.models.families.lfm2 import Lfm2, lfm2_layer_types
from jaxfill.models.families.base import HFTensor
from jaxfill.models.families.qwen3_moe import TRAINING_ONLY
from jaxfill.models.moe import is_moe_layer

RENORMALIZE_EPS = 1e-6  # transformers' Lfm2MoeTopKRouter: w / (w.sum() + 1e-6)


class Lfm2Moe(Lfm2):
    name = "lfm2_moe"
    architectures = ("Lfm2MoeForCausalLM",)
    experts = True
    honoured = frozenset({"layer_types", "norm_eps", "conv_bias", "conv_L_cache", "tie_embedding",
                          "moe_intermediate_size", "num_dense_layers", "num_experts_per_tok", "num_experts",
                          "use_expert_bias", "routed_scaling_factor", "norm_topk_prob"})
    inert = TRAINING_ONLY
    depends = {}
    tested = ("HF f32 logits and greedy tokens (dense first layers, sigmoid routing with its expert bias, scaled "
              "and renormalised weights); through the Engine: unchunked = chunked = prefix-cached (state "
              "snapshots) = tensor 2")

    def model_fields(self, hf):
        types = lfm2_layer_types(hf, attention_by_default=False)  # read first: it names the missing field
        layers = hf["num_hidden_layers"]
        return dict(super().model_fields({**hf, "layer_types": types}), num_experts=int(hf["num_experts"]),
                    experts_per_token=int(hf["num_experts_per_tok"]),
                    moe_intermediate_size=int(hf["moe_intermediate_size"]),
                    dense_layers=tuple(range(min(int(hf.get("num_dense_layers", 2)), layers))),
                    router_scoring="sigmoid", router_bias=bool(hf.get("use_expert_bias", True)),
                    routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
                    router_renormalize=bool(hf.get("norm_topk_prob", True)), router_renormalize_eps=RENORMALIZE_EPS)

    def intermediate_size(self, hf) -> int:
        return int(hf["intermediate_size"])  # the dense layers' width as it stands

    def model_defaults(self, hidden_size):
        return dict(super().model_defaults(hidden_size), num_experts=8, experts_per_token=2,
                    moe_intermediate_size=hidden_size, dense_layers=(0, 1), router_scoring="sigmoid",
                    router_bias=True, router_renormalize=True, router_renormalize_eps=RENORMALIZE_EPS)

    def mlp_tensors(self, c, p, layer):
        if not is_moe_layer(c, layer[1]):
            return super().mlp_tensors(c, p, layer)
        table = expert_tensors(c, p, layer, block="feed_forward", names=("w1", "w3", "w2"))
        if c.moe.selection_bias:
            n = c.moe.num_experts
            table[p + "feed_forward.expert_bias"] = HFTensor(layer + ("mlp", "router_bias"), (n,), (n,), (0,))
        return table


FAMILIES = (Lfm2Moe(),)
