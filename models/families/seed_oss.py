"""Seed-OSS (SeedOssForCausalLM, ByteDance Seed-OSS-36B): Llama's layer with an explicit
head_dim, q/k/v biases (`attention_bias`) apart from the output projection's
(`attention_out_bias`)."""

from __future__ import annotations

from jaxfill.models.families.base import FAMILY_TESTED, Family, activation


class SeedOss(Family):
    name = "seed_oss"
    architectures = ("SeedOssForCausalLM",)
    honoured = frozenset({"hidden_act", "attention_bias", "attention_out_bias"})
    inert = frozenset({"pretraining_tp"})  # a training-time split of the same matmuls
    fixed = {"mlp_bias": False}
    rope_types = ("default", "linear", "llama3", "yarn")
    tested = FAMILY_TESTED

    def model_fields(self, hf):
        return dict(hidden_act=activation(hf), attention_bias=bool(hf.get("attention_bias", True)),
                    attention_out_bias=bool(hf.get("attention_out_bias", False)))

    def model_defaults(self, hidden_size):
        return dict(attention_bias=True)


FAMILIES = (SeedOss(),)
