"""Qwen3 dense: Llama's layer with an RMSNorm on q and k per head, before rope."""

from __future__ import annotations

from jaxfill.models.families.base import (
    FAMILY_TESTED, SLIDING_DEPENDS, Family, activation, sliding_layers, window_fields,
)


class Qwen3(Family):
    name = "qwen3"
    architectures = ("Qwen3ForCausalLM",)
    honoured = frozenset({"hidden_act", "attention_bias", "use_sliding_window", "sliding_window",
                          "max_window_layers", "layer_types"})
    depends = SLIDING_DEPENDS
    tested = FAMILY_TESTED

    def model_fields(self, hf):
        bias = bool(hf.get("attention_bias", False))  # q, k, v and o
        types = sliding_layers(hf, hf["num_hidden_layers"])
        return dict(self.model_defaults(hf["hidden_size"]), hidden_act=activation(hf), attention_bias=bias,
                    attention_out_bias=bias, **window_fields(types, hf.get("sliding_window")))

    def model_defaults(self, hidden_size):
        return dict(qk_norm="head")


FAMILIES = (Qwen3(),)
