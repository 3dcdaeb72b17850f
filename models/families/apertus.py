"""Apertus (ApertusForCausalLM, Swiss AI): Arcee's layer (the ungated MLP) with xIELU as its
activation, whose four scalars per layer load from `mlp.act_fn.*` (models/layers.py XIELU),
q/k RMSNorms per head before rope, and the pre-norms named attention_layernorm and
feedforward_layernorm."""

from __future__ import annotations

from jaxfill.models.families.arcee import Arcee


class Apertus(Arcee):
    name = "apertus"
    architectures = ("ApertusForCausalLM",)
    honoured = frozenset({"hidden_act", "attention_bias"})
    fixed = {}
    norm_names = {"attn_norm": "attention_layernorm", "mlp_norm": "feedforward_layernorm"}
    default_act = "xielu"

    def model_defaults(self, hidden_size):
        return dict(super().model_defaults(hidden_size), qk_norm="head")


FAMILIES = (Apertus(),)
