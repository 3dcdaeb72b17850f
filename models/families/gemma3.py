"""Gemma 3 text: Gemma 2's layer with (1 + w) q/k norms per head, a `layer_types`
pattern (5 sliding : 1 full), and two ropes: sliding layers use the local base
(`rope_local_base_freq`, unscaled), full layers the global one with its scaling.

`Gemma3ForConditionalGeneration` checkpoints load their text tower here: the config's
`text_config`, the weights under `model.language_model.` (transformers 5) or
`language_model.model.` (4); the SigLIP tower and projector load beside the decoder
(models/vision/siglip.py, engine/vision/gemma3_tower.py), not into it."""

from __future__ import annotations

from jaxfill.models.config import freeze
from jaxfill.models.families.base import (
    FAMILY_TESTED, activation, layer_type_ropes, layer_types_from, text_tower_config, window_fields,
)
from jaxfill.models.families.gemma2 import Gemma2, _cap


class Gemma3(Gemma2):
    name = "gemma3"
    architectures = ("Gemma3ForCausalLM",)
    honoured = Gemma2.honoured | {"rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern"}
    # transformers stores attn_logit_softcapping for Gemma 3 but never applies it
    honoured = honoured - {"attn_logit_softcapping"}
    inert = Gemma2.inert | {"attn_logit_softcapping"}
    fixed = {"use_bidirectional_attention": False}
    rope_types = ("default", "linear", "yarn")
    tested = FAMILY_TESTED

    def model_fields(self, hf):
        layers = hf["num_hidden_layers"]
        pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
        types = layer_types_from(hf, layers) or tuple(
            "full" if (n + 1) % pattern == 0 else "sliding" for n in range(layers))
        per_type = layer_type_ropes(self, hf)  # transformers 5: one rope per layer type
        if per_type:
            theta, scaling, local_theta = per_type
        else:
            theta, scaling = self.rope(hf)
            local_theta = hf.get("rope_local_base_freq", 10000.0)
        bias = bool(hf.get("attention_bias", False))
        return dict(
            self.model_defaults(hf["hidden_size"]),
            hidden_act=activation(hf, "hidden_activation", "gelu_pytorch_tanh"), attention_bias=bias,
            attention_out_bias=bias,
            query_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
            final_soft_cap=_cap(hf.get("final_logit_softcapping")),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            rope_theta=float(theta), rope_scaling=freeze(scaling) if scaling else None,
            rope_local_theta=float(local_theta),
            **window_fields(types, hf.get("sliding_window")),
        )

    def model_defaults(self, hidden_size):
        return dict(super().model_defaults(hidden_size), qk_norm="head")

    def common_fields(self, hf):
        rope = hf.get("rope_parameters") or {}
        if "full_attention" in rope or "sliding_attention" in rope:  # read in model_fields
            hf = {k: v for k, v in hf.items() if k != "rope_parameters"}
        return super().common_fields(hf)


class Gemma3Multimodal(Gemma3):
    """The text tower of an image-text checkpoint (its images: engine/vision/gemma3_tower.py)."""
    name = "gemma3"
    architectures = ("Gemma3ForConditionalGeneration",)
    prefix = "model.language_model."
    ignored_prefixes = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
                        "multi_modal_projector.")
    tested = ("HF f32 logits and greedy tokens with one and two images (bidirectional image rows, a prefill "
              "chunk cut before an image), and of the text tower alone")

    def to_model_config(self, hf, architecture):
        text = text_tower_config(hf, "Gemma3ForConditionalGeneration", tie_default=True)
        return super().to_model_config(text, architecture)

    def model_fields(self, hf):
        # Gemma3ForConditionalGeneration's forward never applies final_logit_softcapping
        return dict(super().model_fields(hf), final_soft_cap=None)

    def rename(self, name: str) -> str:
        """transformers-4 names (`language_model.model.layers...`) -> 5's."""
        if name.startswith("language_model.model."):
            return "model.language_model." + name[len("language_model.model."):]
        if name == "language_model.lm_head.weight":
            return "lm_head.weight"
        return name


FAMILIES = (Gemma3(), Gemma3Multimodal())
