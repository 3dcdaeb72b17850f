"""Qwen3-VL (dense): the text tower is Qwen3's layer (q/k RMSNorm per head) under
`model.language_model.`, turned by the multimodal rope: each rotary frequency follows the
t, h or w position of its token, chosen by `mrope_section` in the interleaved layout
(models/rope.py mrope_axes). Text rows have t = h = w = their position, image rows the
image's grid (engine/vision/prompt.py). The vision tower (`model.visual.`) loads beside
the decoder (models/vision/), not into it."""

from __future__ import annotations

from jaxfill.models.config import ConfigError
from jaxfill.models.families.base import Family, activation, text_tower_config

VISION_KEYS = frozenset({"vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
                         "vision_end_token_id"})


class Qwen3VL(Family):
    name = "qwen3_vl"
    architectures = ("Qwen3VLForConditionalGeneration",)
    prefix = "model.language_model."
    ignored_prefixes = ("model.visual.",)
    honoured = frozenset({"hidden_act", "attention_bias"})
    multimodal_rope = True
    tested = ("HF f32 logits and greedy tokens, text-only and with one and two images, chunked "
              "(a boundary inside an image) = prefix-cached = unchunked through the Engine")

    def to_model_config(self, hf, architecture):
        text = text_tower_config(hf, architecture, tie_default=False, outer_tie=True)
        return super().to_model_config(text, architecture)

    def model_fields(self, hf):
        rope = hf.get("rope_parameters") or {}
        section = tuple(int(s) for s in rope.get("mrope_section") or ())
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        if section and (len(section) != 3 or sum(section) != head_dim // 2):
            raise ConfigError(f"config.json mrope_section {list(section)} must be 3 sections summing to "
                              f"head_dim / 2 = {head_dim // 2}")
        if rope.get("mrope_interleaved", True) is not True:
            raise ConfigError("config.json mrope_interleaved=false (Qwen2-VL's blocked layout) is not supported")
        bias = bool(hf.get("attention_bias", False))
        return dict(qk_norm="head", hidden_act=activation(hf), attention_bias=bias, attention_out_bias=bias,
                    mrope_section=section)

    def model_defaults(self, hidden_size):
        return dict(qk_norm="head")


FAMILIES = (Qwen3VL(),)
