"""Qwen3-VL (dense): the text tower is Qwen3's layer (q/k RMSNorm per head) under
`model.language_model.`, turned by the multimodal rope: each rotary frequency follows the
t, h or w position of its token, chosen by `mrope_section` in the interleaved layout
(models/rope.py mrope_axes). Text rows have t = h = w = their position, image rows the
image's grid (engine/vision/prompt.py). The vision tower (`model.visual.`) loads beside
the decoder (models/vision/), not into it."""

from __future__ import annotations

from jaxfill.models.config import ConfigError
from jaxfill.models.families.base import Family, HFTensor, activation, same, text_tower_config
from jaxfill.models.families.qwen3_moe import SPARSE_FIELDS, TRAINING_ONLY, dense_layers, experts_of
from jaxfill.models.moe import is_moe_layer

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


class Qwen3VLMoe(Qwen3VL):
    """Qwen3-VL-MoE (30B-A3B, 235B-A22B): Qwen3-VL's attention, multimodal rope and vision
    tower (DeepStack too) with Qwen3-MoE's sparse MLP: softmax top-k experts, always
    renormalised (its router has no norm_topk_prob), dense where `mlp_only_layers` or
    `decoder_sparse_step` say. The experts are fused per layer (`experts.gate_up_proj`,
    `experts.down_proj`), read in either layout transformers reads (stored_layout)."""
    name = "qwen3_vl_moe"
    architectures = ("Qwen3VLMoeForConditionalGeneration",)
    honoured = Qwen3VL.honoured | (SPARSE_FIELDS - {"norm_topk_prob"})
    inert = TRAINING_ONLY
    experts = True
    tested = ("HF f32 logits and greedy tokens with an image, its rows split over prefill chunks, = unchunked; "
              "a dense layer between sparse ones; both expert layouts")

    def model_fields(self, hf):
        return dict(super().model_fields(hf), num_experts=experts_of(hf), experts_per_token=hf["num_experts_per_tok"],
                    moe_intermediate_size=hf["moe_intermediate_size"], router_renormalize=True,
                    dense_layers=dense_layers(hf, hf["num_hidden_layers"]))

    def model_defaults(self, hidden_size):
        return dict(super().model_defaults(hidden_size), num_experts=8, experts_per_token=2,
                    moe_intermediate_size=hidden_size, router_renormalize=True)

    def mlp_tensors(self, c, p, layer):
        if not is_moe_layer(c, layer[1]):
            return super().mlp_tensors(c, p, layer)
        e, h, i, m = c.moe.num_experts, c.hidden_size, c.moe.intermediate_size, layer + ("mlp",)
        return {  # as Qwen publishes them: [E, H, 2I] (gate columns, then up) -> [E, H, 2, I]; [E, I, H]
            p + "mlp.gate.weight": HFTensor(m + ("router",), (e, h), (e, h), (1, 0)),
            p + "mlp.experts.gate_up_proj": HFTensor(m + ("experts_gate_up",), (e, h, 2 * i), (e, h, 2, i),
                                                     (0, 1, 2, 3)),
            p + "mlp.experts.down_proj": same(m + ("experts_down",), (e, i, h)),
        }

    def stored_layout(self, name, shape, parts):
        """transformers 5 holds the experts as [E, 2I, H] and [E, H, I] and writes them so
        (save_pretrained); it reads a tensor of that shape as such and transposes any other
        (its Transpose(check_dims) conversion): the same rule here."""
        spec = parts[0]
        if name.endswith("mlp.experts.gate_up_proj"):
            e, h, _, i = spec.stored_shape
            if tuple(shape) == (e, 2 * i, h):
                return (HFTensor(spec.param_path, (e, 2 * i, h), (e, 2, i, h), (0, 3, 1, 2)),)
        elif name.endswith("mlp.experts.down_proj"):
            e, i, h = spec.hf_shape
            if tuple(shape) == (e, h, i):
                return (HFTensor(spec.param_path, (e, h, i), (e, h, i), (0, 2, 1)),)
        return parts


FAMILIES = (Qwen3VL(), Qwen3VLMoe())
