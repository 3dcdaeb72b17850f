"""OLMoE (OlmoeForCausalLM): Llama's layer with OLMo 2's q/k RMSNorms over the whole
projection (all heads at once) before rope, q/k/v optionally clipped (`clip_qkv`), and
every MLP a mixture of experts routed by a softmax over all experts, top k, renormalised
only with `norm_topk_prob`. No new math beyond the clip: the config and tensor mapping."""

from __future__ import annotations

from jaxfill.models.families.base import Family, activation
from jaxfill.models.families.experts import expert_tensors
from jaxfill.models.families.qwen3_moe import TRAINING_ONLY, experts_of

TESTED = ("HF f32 logits and greedy tokens (projection q/k norms, a binding clip_qkv, softmax top-k routing "
          "not renormalised); through the Engine prefix-cached = expert 4 = expert 2 x tensor 2")


class Olmoe(Family):
    name = "olmoe"
    architectures = ("OlmoeForCausalLM",)
    honoured = frozenset({"hidden_act", "attention_bias", "clip_qkv", "num_experts", "num_local_experts",
                          "num_experts_per_tok", "norm_topk_prob"})
    inert = TRAINING_ONLY
    experts = True
    tested = TESTED

    def model_fields(self, hf):
        bias, clip = bool(hf.get("attention_bias", False)), hf.get("clip_qkv")
        return dict(self.model_defaults(hf["hidden_size"]), hidden_act=activation(hf), attention_bias=bias,
                    attention_out_bias=bias, qkv_clip=None if clip is None else float(clip),
                    num_experts=experts_of(hf), experts_per_token=int(hf["num_experts_per_tok"]),
                    moe_intermediate_size=hf["intermediate_size"],
                    router_renormalize=bool(hf.get("norm_topk_prob", False)))

    def model_defaults(self, hidden_size):
        # HF's norm is Llama's (w times the normed x cast back), not OLMo 2's f32 product
        return dict(qk_norm="projection", num_experts=8, experts_per_token=2, moe_intermediate_size=hidden_size,
                    router_renormalize=False)

    def mlp_tensors(self, c, p, layer):
        return expert_tensors(c, p, layer)


FAMILIES = (Olmoe(),)
