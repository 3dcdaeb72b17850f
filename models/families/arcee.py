"""Arcee (ArceeForCausalLM: AFM-4.5B): Llama's layer with the ungated MLP,
down(act(up(x))), squared ReLU by default."""

from __future__ import annotations

from jaxfill.models.families.base import FAMILY_TESTED, Family, activation


class Arcee(Family):
    name = "arcee"
    architectures = ("ArceeForCausalLM",)
    honoured = frozenset({"hidden_act", "attention_bias"})
    fixed = {"mlp_bias": False}
    rope_types = ("default", "linear", "llama3", "yarn")
    tested = FAMILY_TESTED
    default_act = "relu2"

    def model_fields(self, hf):
        bias = bool(hf.get("attention_bias", False))  # q, k, v and o
        return dict(self.model_defaults(hf["hidden_size"]), attention_bias=bias, attention_out_bias=bias,
                    hidden_act=activation(hf, default=self.default_act, extra=(self.default_act,)))

    def model_defaults(self, hidden_size):
        return dict(mlp_gated=False, hidden_act=self.default_act)

    def mlp_tensors(self, c, p, layer):
        return self.ungated_mlp_tensors(c, p, layer)


FAMILIES = (Arcee(),)
