"""Phi-3.5-MoE (PhimoeForCausalLM): Mistral-shaped attention (optionally biased, an optional
window) between LayerNorms with biases (norm_kind "layer"), an LM head with an optional
bias, and every MLP a mixture of experts routed by sparsemixer (models/moe.py: two experts
in turn, each weighted within its `router_jitter_noise` neighbourhood, not renormalised).
Rope: default or longrope, whose cos/sin transformers scales by `short_mscale` (by
`long_mscale` past original_max_position_embeddings) while the inverse frequencies stay the
short factors' at every length; with the two mscales equal (the published checkpoint) the
rope is the same at every length, so the context is not capped. Experts at
block_sparse_moe.experts.{j}.w1 (gate), w3 (up), w2 (down), the router at
block_sparse_moe.gate, as Mixtral."""

from __future__ import annotations

from jaxfill.models.config import ConfigError
from jaxfill.models.families.base import Family, activation
from jaxfill.models.families.experts import expert_tensors

TESTED = ("HF f32 logits and greedy tokens (sparsemixer routing, LayerNorms with biases, biased attention and "
          "LM head, longrope past its original context)")


class Phimoe(Family):
    name = "phimoe"
    architectures = ("PhimoeForCausalLM",)
    honoured = frozenset({"hidden_act", "sliding_window", "num_local_experts", "router_jitter_noise",
                          "attention_bias", "lm_head_bias", "original_max_position_embeddings"})
    # training only; num_experts_per_tok: transformers' sparsemixer picks two experts whatever it says
    inert = frozenset({"router_aux_loss_coef", "output_router_logits", "input_jitter_noise", "num_experts_per_tok"})
    rope_types = ("default", "longrope")
    experts = True
    tested = TESTED

    def model_fields(self, hf):
        bias = bool(hf.get("attention_bias", False))
        return dict(self.model_defaults(hf["hidden_size"]), hidden_act=activation(hf), attention_bias=bias,
                    attention_out_bias=bias, sliding_window=hf.get("sliding_window") or None,
                    lm_head_bias=bool(hf.get("lm_head_bias", False)), num_experts=int(hf["num_local_experts"]),
                    moe_intermediate_size=hf["intermediate_size"],
                    sparsemixer_eps=float(hf.get("router_jitter_noise", 0.01)))

    def model_defaults(self, hidden_size):
        return dict(norm_kind="layer", num_experts=8, experts_per_token=2, moe_intermediate_size=4 * hidden_size,
                    router_scoring="sparsemixer", router_renormalize=False)

    def rope(self, hf, rope=None):
        theta, scaling = super().rope(hf, rope)
        if scaling is not None:  # longrope: cos/sin times short_mscale, not the derived attention factor
            mscale = scaling.pop("short_mscale", None)
            scaling.pop("long_mscale", None)
            if mscale is None:
                raise ConfigError("phimoe: longrope needs short_mscale and long_mscale")
            scaling["attention_factor"] = float(mscale)
        return theta, scaling

    def longrope_caps_context(self, hf):
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        return rope.get("short_mscale") != rope.get("long_mscale")

    def mlp_tensors(self, c, p, layer):
        return expert_tensors(c, p, layer, "block_sparse_moe", ("w1", "w3", "w2"))


FAMILIES = (Phimoe(),)
