"""OLMo 2: norms after attention and MLP only (none before), and q/k RMSNorms over the
whole projection (all heads at once) before rope; norms multiply in f32, and q and k turn
in f32 (transformers keeps OLMo's cos and sin in f32)."""

from __future__ import annotations

from jaxfill.models.families.base import FAMILY_TESTED, Family, activation


class Olmo2(Family):
    name = "olmo2"
    architectures = ("Olmo2ForCausalLM",)
    honoured = frozenset({"hidden_act", "attention_bias"})
    norm_names = {"attn_post_norm": "post_attention_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}
    tested = FAMILY_TESTED

    def model_fields(self, hf):
        bias = bool(hf.get("attention_bias", False))
        return dict(self.model_defaults(hf["hidden_size"]), hidden_act=activation(hf), attention_bias=bias,
                    attention_out_bias=bias)

    def model_defaults(self, hidden_size):
        return dict(norm_kind="rms_f32", norm_layout="post", qk_norm="projection", rope_f32=True)


FAMILIES = (Olmo2(),)
