"""GLM (GlmForCausalLM: glm-4-9b) and GLM-4 (Glm4ForCausalLM: GLM-4-0414, GLM-Z1): Llama's
attention with q/k/v biases (o unbiased), rope over the first `partial_rotary_factor` of
each head (0.5 unless the file says otherwise) turning interleaved pairs (x0, x1), (x2,
x3)..., and gate and up fused in one `gate_up_proj` (split at load, as Phi-3's). GLM-4
adds a norm after attention and one after the MLP (input_layernorm, post_self_attn_layernorm,
post_attention_layernorm before the MLP, post_mlp_layernorm)."""

from __future__ import annotations

from jaxfill.models.families.base import FAMILY_TESTED, Family, activation
from jaxfill.models.families.phi3 import Phi3


class Glm(Family):
    name = "glm"
    architectures = ("GlmForCausalLM",)
    # partial_rotary_factor: top-level in transformers-4 files, in rope_parameters in 5's
    honoured = frozenset({"hidden_act", "attention_bias", "partial_rotary_factor"})
    partial_rotary = True
    rope_types = ("default", "linear", "llama3", "yarn")
    tested = FAMILY_TESTED

    def model_fields(self, hf):
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        rope = hf.get("rope_parameters") or {}
        partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))
        return dict(self.model_defaults(hf["hidden_size"]), hidden_act=activation(hf),
                    attention_bias=bool(hf.get("attention_bias", True)), rotary_dim=int(head_dim * partial))

    def model_defaults(self, hidden_size):
        return dict(attention_bias=True, attention_out_bias=False, rope_interleave=True)

    mlp_tensors = Phi3.mlp_tensors


class Glm4(Glm):
    name = "glm4"
    architectures = ("Glm4ForCausalLM",)
    norm_names = {"attn_norm": "input_layernorm", "attn_post_norm": "post_self_attn_layernorm",
                  "mlp_norm": "post_attention_layernorm", "mlp_post_norm": "post_mlp_layernorm"}

    def model_defaults(self, hidden_size):
        return dict(super().model_defaults(hidden_size), norm_layout="sandwich")


FAMILIES = (Glm(), Glm4())
