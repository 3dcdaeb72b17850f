"""Qwen3.5 (text): three Gated DeltaNet layers for every full-attention layer
(`layer_types`: "linear_attention" / "full_attention"; models/mixers/gated_deltanet.py). The
full-attention layers gate their output per head (q_proj gives [q, gate] per head), norm
q and k per head, and turn only the first `partial_rotary_factor` of each head with rope.
Every RMSNorm but the DeltaNet's own is Gemma's (1 + w) in f32. Text positions make
Qwen3.5's multimodal rope (mrope) the plain one, so its sections are inert here."""

from __future__ import annotations

from jaxfill.models.config import ConfigError
from jaxfill.models.families.base import Family, HFTensor, activation, same
from jaxfill.models.linear_state import conv_dim

LAYER_KINDS = ("linear_attention", "full_attention")


class Qwen3_5(Family):
    name = "qwen3_5"
    architectures = ("Qwen3_5ForCausalLM",)
    honoured = frozenset({"hidden_act", "layer_types", "linear_conv_kernel_dim", "linear_key_head_dim",
                          "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
                          "partial_rotary_factor", "full_attention_interval", "mtp_num_hidden_layers",
                          "num_nextn_predict_layers", "mtp_use_dedicated_embeddings"})
    fixed = {"attention_bias": False, "attn_output_gate": True, "mamba_ssm_dtype": "float32"}
    # multi-token-prediction layers (`mtp.*`): read into mtp_layers, loaded only as the
    # proposer of speculative.method = "mtp" (models/families/qwen_mtp_tensors.py)
    ignored_prefixes = ("mtp.",)
    mtp_naming = "qwen"  # mtp.fc, mtp.layers.0.*, ... (not DeepSeek's model.layers.{L}.*)
    partial_rotary = True
    mixers = ("attention", "gated_deltanet")
    tested = ("HF f32 logits and greedy tokens (model level: prefill in chunks carrying the state, then "
              "decode); through the Engine: state slots reused, prefix-cached = uncached, sync and async")

    def model_fields(self, hf):
        layers = hf["num_hidden_layers"]
        every = int(hf.get("full_attention_interval") or 4)
        types = hf.get("layer_types") or [("full_attention" if (n + 1) % every == 0 else "linear_attention")
                                          for n in range(layers)]
        if len(types) != layers or set(types) - set(LAYER_KINDS):
            raise ConfigError(f"config.json layer_types must name {list(LAYER_KINDS)} once per layer, got {types}")
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        rope = hf.get("rope_parameters") or {}
        partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        return dict(hidden_act=activation(hf), qk_norm="head", norm_kind="rms_one_plus", attn_output_gate=True,
                    rotary_dim=int(head_dim * partial),
                    linear_layers=tuple(n for n, t in enumerate(types) if t == "linear_attention"),
                    linear_num_key_heads=hf["linear_num_key_heads"],
                    linear_num_value_heads=hf["linear_num_value_heads"],
                    linear_key_head_dim=hf["linear_key_head_dim"], linear_value_head_dim=hf["linear_value_head_dim"],
                    linear_conv_kernel=hf.get("linear_conv_kernel_dim", 4),
                    mtp_layers=int(hf.get("mtp_num_hidden_layers") or hf.get("num_nextn_predict_layers") or 0))

    def skipped_prefixes(self, config, hf):
        """The MTP layers (`mtp.*`) are skipped unless the engine runs the first as a proposer
        (models/families/qwen_mtp_tensors.py)."""
        from jaxfill.models.families.qwen_mtp_tensors import skipped_qwen_mtp_prefixes

        return skipped_qwen_mtp_prefixes(self.ignored_prefixes, config, hf)

    def model_defaults(self, hidden_size):
        return dict(qk_norm="head", norm_kind="rms_one_plus", attn_output_gate=True, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)

    def layer_tensors(self, c, p, layer):
        if layer[1] not in c.linear.layers:
            return super().layer_tensors(c, p, layer)
        e, hk, hv, dk, dv, k = (c.hidden_size, c.linear.num_key_heads, c.linear.num_value_heads,
                                c.linear.key_head_dim, c.linear.value_head_dim, c.linear.conv_kernel)
        a, la = layer + ("attn",), p + "linear_attn."
        cd, qk, vw = conv_dim(c), hk * dk, hv // hk * dv  # channels q | k | v; v per key-head group
        # in_proj_qkv and conv1d hold q, k, v heads in turn: each part is its own rows, split by key head
        parts = (("q", (0, qk), dk), ("k", (qk, 2 * qk), dk), ("v", (2 * qk, cd), vw))
        return {
            **self.mlp_tensors(c, p, layer),
            **{p + hf + ".weight": same(layer + (ours, "weight"), (e,)) for ours, hf in self.norm_names.items()},
            la + "in_proj_qkv.weight": tuple(HFTensor(a + (n,), (cd, e), (hk, w, e), (2, 0, 1), rows)
                                             for n, rows, w in parts),
            la + "conv1d.weight": tuple(HFTensor(a + ("conv_" + n,), (cd, 1, k), (hk, w, k), (0, 1, 2), rows)
                                        for n, rows, w in parts),
            la + "in_proj_z.weight": HFTensor(a + ("z",), (hv * dv, e), (hv, dv, e), (2, 0, 1)),
            la + "in_proj_b.weight": HFTensor(a + ("b",), (hv, e), (hv, e), (1, 0)),
            la + "in_proj_a.weight": HFTensor(a + ("a",), (hv, e), (hv, e), (1, 0)),
            la + "dt_bias": same(a + ("dt_bias",), (hv,)),
            la + "A_log": same(a + ("a_log",), (hv,)),
            la + "norm.weight": same(a + ("norm",), (dv,)),
            la + "out_proj.weight": HFTensor(a + ("out",), (e, hv * dv), (e, hv, dv), (1, 2, 0)),
        }

    def attention_tensors(self, c, p, layer):
        table = super().attention_tensors(c, p, layer)
        e, d, hq = c.hidden_size, c.head_dim, c.num_heads
        # [Hq * 2D, E]: per head D query rows, then D gate rows
        table[p + "self_attn.q_proj.weight"] = HFTensor(layer + ("attn", "q"), (hq * 2 * d, e), (hq, 2 * d, e),
                                                        (2, 0, 1))
        return table


class Qwen3_5Multimodal(Qwen3_5):
    """An image-text Qwen3.5 checkpoint (what Qwen/Qwen3.5-* publish): the config's
    `text_config`, the weights under `model.language_model.`, the MTP layers skipped. Its
    vision tower (`model.visual.`: Qwen3-VL's without DeepStack) loads beside the decoder
    (engine/vision/), and the attention layers turn the quarter of each head they rope with
    the (t, h, w) sections of `mrope_section` (models/rope.py mrope_axes)."""
    name = "qwen3_5_vl"
    architectures = ("Qwen3_5ForConditionalGeneration",)
    prefix = "model.language_model."
    ignored_prefixes = ("model.visual.", "mtp.")
    multimodal_rope = True
    tested = "HF f32 logits and greedy tokens with an image, its rows split over prefill chunks (engine/vision/)"

    def model_fields(self, hf):
        rope = hf.get("rope_parameters") or {}
        section = tuple(int(s) for s in rope.get("mrope_section") or ())
        fields = super().model_fields(hf)
        if section and sum(section) != fields["rotary_dim"] // 2:
            raise ConfigError(f"config.json mrope_section {list(section)} must sum to the roped half-dims "
                              f"{fields['rotary_dim'] // 2}")
        if rope.get("mrope_interleaved", True) is not True:
            raise ConfigError("config.json mrope_interleaved=false (Qwen2-VL's blocked layout) is not supported")
        return dict(fields, mrope_section=section)

    def to_model_config(self, hf, architecture):
        text = dict(hf.get("text_config") or {})
        if not text:
            raise ConfigError("Qwen3_5ForConditionalGeneration config.json has no text_config")
        text["tie_word_embeddings"] = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        for key in ("dtype", "torch_dtype"):
            if key in hf and key not in text:
                text[key] = hf[key]
        return super().to_model_config(text, architecture)


FAMILIES = (Qwen3_5(), Qwen3_5Multimodal())
