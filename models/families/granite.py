"""Granite 3: Llama's layer with four multipliers (embeddings, residual branches,
attention scores, logits)."""

from __future__ import annotations

from jaxfill.models.families.base import FAMILY_TESTED, Family, activation


class Granite(Family):
    name = "granite"
    architectures = ("GraniteForCausalLM",)
    honoured = frozenset({"hidden_act", "attention_bias", "embedding_multiplier", "residual_multiplier",
                          "attention_multiplier", "logits_scaling"})
    fixed = {"mlp_bias": False}
    tested = FAMILY_TESTED

    def model_fields(self, hf):
        bias = bool(hf.get("attention_bias", False))
        return dict(hidden_act=activation(hf), attention_bias=bias, attention_out_bias=bias,
                    embed_scale=float(hf.get("embedding_multiplier", 1.0)),
                    residual_scale=float(hf.get("residual_multiplier", 1.0)),
                    query_scale=float(hf.get("attention_multiplier", 1.0)),
                    logits_scale=1.0 / float(hf.get("logits_scaling", 1.0)))


FAMILIES = (Granite(),)
