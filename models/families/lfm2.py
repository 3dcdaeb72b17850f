"""LFM2 (Lfm2ForCausalLM): pre-norm layers whose mixer is either attention (GQA, rope, an
RMSNorm over each head of q and of k before rope) or LFM2's gated short convolution
(models/mixers/short_conv.py), by `layer_types` ("full_attention" / "conv"; absent, by
`full_attn_idxs`, every layer attention when that is absent too). The MLP is SwiGLU
(w1 gate, w3 up, w2 down) whose width transformers derives from intermediate_size when
`block_auto_adjust_ff_dim`: int(2 I / 3), times `block_ffn_dim_multiplier`, rounded up to
`block_multiple_of`. Norms are Llama's; the final one is called `embedding_norm`.

The original LiquidAI config.json spells some fields its own way (`tie_embedding`,
`block_ff_dim`), which transformers reads in place of the standard ones, and carries
fields transformers never reads (inert here).
"""

from __future__ import annotations

from jaxfill.models.config import ConfigError
from jaxfill.models.families.base import Family, HFTensor, same

LAYER_KINDS = ("full_attention", "conv")
DEFAULT_THETA = 1e6  # transformers' Lfm2Config.default_theta, when config.json names none
NORMS = {"attn_norm": "operator_norm", "mlp_norm": "ffn_norm"}
# The original LiquidAI config.json's fields transformers never reads
LIQUID_INERT = frozenset({"block_dim", "block_mlp_init_scale", "block_out_init_scale", "block_use_swiglu",
                          "block_use_xavier_init", "block_norm_eps", "conv_dim", "conv_dim_out",
                          "conv_use_xavier_init", "num_heads", "theta", "use_pos_enc"})


def lfm2_layer_types(hf: dict, attention_by_default: bool = True) -> list[str]:
    """Each layer's mixer as transformers reads it: `layer_types`, else `full_attn_idxs`
    (Lfm2Config only: `attention_by_default`), else every layer attention."""
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        if not attention_by_default:
            raise ConfigError("config.json has no layer_types (transformers cannot build the model without them)")
        idxs = hf.get("full_attn_idxs")
        idxs = range(layers) if idxs is None else set(idxs)
        types = ["full_attention" if n in idxs else "conv" for n in range(layers)]
    if len(types) != layers or set(types) - set(LAYER_KINDS):
        raise ConfigError(f"config.json layer_types must name {list(LAYER_KINDS)} once per layer, got {types}")
    if "full_attention" not in types:
        raise ConfigError("config.json layer_types has no full_attention layer: not supported (the engine sizes "
                          "its page pool by the attention layers)")
    return list(types)


def mlp_width(hf: dict) -> int:
    """The SwiGLU width transformers' Lfm2MLP builds from the config."""
    width = int(hf["intermediate_size"])
    if not hf.get("block_auto_adjust_ff_dim", True):
        return width
    width = int(2 * width / 3)
    multiplier = hf.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is None:
        return width
    width, multiple = int(multiplier * width), int(hf.get("block_multiple_of", 256))
    return multiple * ((width + multiple - 1) // multiple)


class Lfm2(Family):
    name = "lfm2"
    architectures = ("Lfm2ForCausalLM",)
    honoured = frozenset({"layer_types", "full_attn_idxs", "norm_eps", "conv_bias", "conv_L_cache",
                          "block_multiple_of", "block_ffn_dim_multiplier", "block_auto_adjust_ff_dim",
                          "tie_embedding", "block_ff_dim"})
    inert = LIQUID_INERT
    # full_attn_idxs counts only without layer_types; the width fields only while auto-adjusting, and
    # past the rounding to block_multiple_of
    depends = {"full_attn_idxs": {"layer_types": None}, "block_multiple_of": {"block_ffn_dim_multiplier": 1.0},
               "intermediate_size": {"block_multiple_of": 16},
               "block_ffn_dim_multiplier": {"block_auto_adjust_ff_dim": True, "block_multiple_of": 16}}
    mixers = ("attention", "short_conv")
    tested = ("HF f32 logits and greedy tokens (model level: prefill in chunks carrying the conv state); "
              "through the Engine: unchunked = chunked = prefix-cached (state snapshots) = tensor 2")

    def to_model_config(self, hf, architecture):
        hf = dict(hf)  # transformers reads the original config's spellings in place of the standard ones
        if "tie_embedding" in hf:
            hf["tie_word_embeddings"] = hf["tie_embedding"]
        if "block_ff_dim" in hf:
            hf["intermediate_size"] = hf["block_ff_dim"]
        return super().to_model_config(hf, architecture)

    def rope(self, hf, rope=None):
        rope = rope if rope is not None else (hf.get("rope_parameters") or {})
        if "rope_theta" not in rope and "rope_theta" not in hf:
            rope = {**rope, "rope_theta": DEFAULT_THETA}
        return super().rope(hf, rope)

    def model_fields(self, hf):
        types = lfm2_layer_types(hf)
        return dict(self.model_defaults(hf["hidden_size"]), rms_norm_eps=hf.get("norm_eps", 1e-5),
                    tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
                    intermediate_size=self.intermediate_size(hf),
                    linear_layers=tuple(n for n, t in enumerate(types) if t == "conv"),
                    linear_conv_kernel=int(hf.get("conv_L_cache", 3)), linear_conv_bias=bool(hf.get("conv_bias")))

    def intermediate_size(self, hf) -> int:
        return mlp_width(hf)

    def model_defaults(self, hidden_size):
        return dict(qk_norm="head", linear_kind="short_conv", linear_conv_kernel=3, tie_word_embeddings=True)

    # --- tensors -----------------------------------------------------------------------
    def tensors(self, config):
        table = super().tensors(config)
        table["model.embedding_norm.weight"] = table.pop("model.norm.weight")
        return table

    def layer_tensors(self, c, p, layer):
        e, d = c.hidden_size, c.head_dim
        table = {p + hf + ".weight": same(layer + (ours, "weight"), (e,)) for ours, hf in NORMS.items()}
        table.update(self.mlp_tensors(c, p, layer))
        a = layer + ("attn",)
        if layer[1] in c.linear.layers:
            return {**table, **short_conv_tensors(c, p + "conv.", a)}
        attn = self.attention_tensors(c, p, layer)
        attn[p + "self_attn.out_proj.weight"] = attn.pop(p + "self_attn.o_proj.weight")
        return {**table, **attn, p + "self_attn.q_layernorm.weight": same(a + ("q_norm", "weight"), (d,)),
                p + "self_attn.k_layernorm.weight": same(a + ("k_norm", "weight"), (d,))}

    def mlp_tensors(self, c, p, layer):
        e, i = c.hidden_size, c.intermediate_size
        m = layer + ("mlp",)
        return {
            p + "feed_forward.w1.weight": HFTensor(m + ("gate",), (i, e), (i, e), (1, 0)),
            p + "feed_forward.w3.weight": HFTensor(m + ("up",), (i, e), (i, e), (1, 0)),
            p + "feed_forward.w2.weight": HFTensor(m + ("down",), (e, i), (e, i), (1, 0)),
        }


def short_conv_tensors(c, m: str, a: tuple) -> dict:
    """One short-convolution mixer's tensors (HF names under `m`) -> its params under `a`:
    in_proj's rows are [B, C, x], each its own param; the depthwise conv [E, 1, K] -> [E, K]."""
    e, k = c.hidden_size, c.linear.conv_kernel
    parts = (("b", (0, e)), ("c", (e, 2 * e)), ("x", (2 * e, 3 * e)))
    table = {
        m + "in_proj.weight": tuple(HFTensor(a + (n,), (3 * e, e), (e, e), (1, 0), rows) for n, rows in parts),
        m + "conv.weight": HFTensor(a + ("conv",), (e, 1, k), (e, k), (0, 1)),
        m + "out_proj.weight": HFTensor(a + ("out",), (e, e), (e, e), (1, 0)),
    }
    if c.linear.conv_bias:
        table[m + "in_proj.bias"] = tuple(HFTensor(a + (n + "_bias",), (3 * e,), (e,), (0,), rows) for n, rows in parts)
        table[m + "conv.bias"] = same(a + ("conv_bias",), (e,))
        table[m + "out_proj.bias"] = same(a + ("out_bias",), (e,))
    return table


FAMILIES = (Lfm2(),)
