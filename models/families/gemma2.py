"""Gemma 2: norms before and after attention and MLP, (1 + w) RMSNorm in f32, GeGLU
(tanh gelu), embeddings times sqrt(hidden) rounded to the dtype, softmax scale
query_pre_attn_scalar ** -0.5, tanh soft caps on attention scores and on the logits,
sliding and full layers alternating."""

from __future__ import annotations

from jaxfill.models.families.base import FAMILY_TESTED, Family, activation, layer_types_from, window_fields


class Gemma2(Family):
    name = "gemma2"
    architectures = ("Gemma2ForCausalLM",)
    honoured = frozenset({"hidden_activation", "attention_bias", "query_pre_attn_scalar", "sliding_window",
                          "layer_types", "final_logit_softcapping", "attn_logit_softcapping"})
    inert = frozenset({"hidden_act"})  # transformers-4 files carry it; the MLP reads hidden_activation
    fixed = {"use_bidirectional_attention": None}
    rope_types = ("default", "linear", "yarn")
    norm_names = {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
                  "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}
    tested = FAMILY_TESTED

    def default_layer_types(self, layers: int) -> tuple[str, ...]:
        return tuple("sliding" if n % 2 == 0 else "full" for n in range(layers))

    def model_fields(self, hf):
        layers = hf["num_hidden_layers"]
        types = layer_types_from(hf, layers) or self.default_layer_types(layers)
        bias = bool(hf.get("attention_bias", False))
        return dict(
            self.model_defaults(hf["hidden_size"]),
            hidden_act=activation(hf, "hidden_activation", "gelu_pytorch_tanh"),
            attention_bias=bias, attention_out_bias=bias,
            query_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
            attn_soft_cap=_cap(hf.get("attn_logit_softcapping")),
            final_soft_cap=_cap(hf.get("final_logit_softcapping")),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            **window_fields(types, hf.get("sliding_window")),
        )


    def model_defaults(self, hidden_size):
        return dict(hidden_act="gelu_tanh", norm_kind="rms_one_plus", norm_layout="sandwich",
                    embed_scale=float(hidden_size) ** 0.5, tie_word_embeddings=True)


def _cap(value):
    return float(value) if value else None


FAMILIES = (Gemma2(),)
