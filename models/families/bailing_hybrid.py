"""Ling 2.5 / Ring 2.5 (BailingHybridForCausalLM): Kimi Linear's stack with three changes.
Its linear layers are Kimi Delta Attention (models/mixers/kda.py) with the forget and
output gates projected E -> H x D straight (f_proj, g_proj; Kimi has rank-D bottlenecks)
and, by default (`kda_safe_gate`), a bounded log decay kda_lower_bound * sigmoid(exp(A_log)
(f + dt_bias)); its full-attention layers are DeepSeek V3's MLA with rope (interleaved,
YaRN's mscale as V3 has it) and each head's output times sigmoid(x @ g_proj) (one scalar
per head, `mla_head_gate`); its MLP is V3's (dense first layers, then sigmoid grouped
routing with a correction bias beside shared experts).

Which layer is which: `layer_types`, else full attention at the last layer of every
`layer_group_size` group; `mlp_layer_types`, else dense below `first_k_dense_replace`. The
KDA heads are transformers' derivation: num_attention_heads heads of `head_dim` (as
config.json says it, before transformers overwrites head_dim with qk_rope_head_dim),
convolution kernel `short_conv_kernel_size`. Tensors are read under the names Ling's
files (and save_pretrained) use: word_embeddings, `attention.` with its `dense` output
projection and separate q/k/v convolutions, the router's `expert_bias`. The
multi-token-prediction layers after the last decoder layer are skipped.

Refused by name: SwiGLU clipping (a non-zero `expert_swiglu_limit_list` /
`share_expert_swiglu_limit_list` entry: a per-layer clamp our MoE does not carry), an
activation other than SiLU, biases.
"""

from __future__ import annotations

from jaxfill.models.config import ConfigError
from jaxfill.models.families.base import Family, HFTensor, same
from jaxfill.models.families.deepseek import DeepseekV3
from jaxfill.models.families.experts import grouped_sigmoid_moe_tensors
from jaxfill.models.families.kimi_linear import LAYER_KINDS, MLP_KINDS, KimiLinear, read
from jaxfill.models.moe import is_moe_layer

LIMITS = ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list", "swiglu_limits", "swiglu_limits_shared")
# Ling's file names -> the names the tables below use (transformers' runtime names, but
# for the q/k/v convolutions, kept apart, and the forget gate's, flat)
RENAMES = (("model.word_embeddings.", "model.embed_tokens."), (".attention.", ".self_attn."),
           (".self_attn.dense.", ".self_attn.o_proj."), (".mlp.gate.expert_bias", ".mlp.gate.e_score_correction_bias"),
           (".self_attn.forget_gate.", ".self_attn."))


def kinds(hf: dict, key: str, allowed: tuple, default: list) -> list:
    types = list(hf.get(key) or default)
    if len(types) != len(default) or set(types) - set(allowed):
        raise ConfigError(f"config.json {key} must name {list(allowed)} once per layer, got {types}")
    return types


class BailingHybrid(KimiLinear):
    name = "bailing_hybrid"
    architectures = ("BailingHybridForCausalLM",)
    moe_defaults = (512, 8, 4, 2.5)  # BailingHybridConfig's
    honoured = (KimiLinear.honoured - {"linear_attn_config", "linear_head_dim", "linear_num_heads",
                                       "linear_conv_kernel_dim"}) | {"head_dim", "short_conv_kernel_size",
                                                                     "layer_group_size", "kda_safe_gate",
                                                                     "kda_lower_bound", *LIMITS}
    # linear_*: transformers derives them from head_dim, num_attention_heads and
    # short_conv_kernel_size whatever the file says; qk_head_dim: nope + rope; the
    # multi-token-prediction layers are skipped (skipped_prefixes), their loss a training term
    inert = (KimiLinear.inert - {"head_dim"}) | {"linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim",
                                                  "num_mtp_layers", "num_nextn_predict_layers",
                                                  "mtp_loss_scaling_factor"}
    fixed = {"attention_bias": False, "hidden_act": "silu"}
    tested = ("HF f32 logits and greedy tokens (KDA with full-rank gates and the bounded decay x3 : roped MLA "
              "with its per-head gate, a dense first layer, sigmoid grouped MoE + shared expert); through the "
              "Engine: chunked = prefix-cached with state snapshots = tensor 2")

    def rope(self, hf, rope=None):
        return Family.rope(self, hf, rope)

    def model_fields(self, hf):
        layers = int(hf["num_hidden_layers"])
        group = int(hf.get("layer_group_size") or 6)
        types = kinds(hf, "layer_types", LAYER_KINDS,
                      ["full_attention" if (n + 1) % group == 0 else "linear_attention" for n in range(layers)])
        first = int(hf.get("first_k_dense_replace", 2))
        mlp = kinds(hf, "mlp_layer_types", MLP_KINDS, ["dense" if n < first else "sparse" for n in range(layers)])
        for key in LIMITS:
            if any(float(v) != 0 for v in hf.get(key) or ()):
                raise ConfigError(f"config.json {key} = {hf[key]} clips the SwiGLU of some layer; only 0 (no "
                                  "clipping) is supported")
        # DeepSeek V3's MLA fields (rope, the YaRN mscale on the softmax scale); no experts there
        fields = DeepseekV3.model_fields(self, {**hf, "rope_interleave": True, "n_routed_experts": 0})
        heads, dim = int(hf["num_attention_heads"]), int(hf.get("head_dim") or 128)
        safe = hf.get("kda_safe_gate", True)
        fields.update(mla_head_gate=True, max_position_embeddings=int(read(hf, "max_position_embeddings", 262144)),
                      linear_kind="kda", linear_layers=tuple(n for n, t in enumerate(types) if t == "linear_attention"),
                      linear_num_key_heads=heads, linear_num_value_heads=heads, linear_key_head_dim=dim,
                      linear_value_head_dim=dim, linear_conv_kernel=int(hf.get("short_conv_kernel_size", 4)),
                      linear_full_rank_gates=True,
                      linear_gate_lower_bound=float(hf.get("kda_lower_bound", -5.0)) if safe else None)
        if "sparse" in mlp:
            fields.update(self.moe_fields(hf, mlp))
        return fields

    def model_defaults(self, hidden_size):
        return dict(super().model_defaults(hidden_size), rope_interleave=True, mla_head_gate=True,
                    linear_full_rank_gates=True, linear_gate_lower_bound=-5.0)

    # --- tensors -----------------------------------------------------------------------
    def rename(self, name: str) -> str:
        for old, new in RENAMES:
            name = name.replace(old, new)
        return name

    def attention_tensors(self, c, p, layer):
        e, h = c.hidden_size, c.num_heads
        return {**DeepseekV3.attention_tensors(self, c, p, layer),
                p + "self_attn.g_proj.weight": HFTensor(layer + ("attn", "g"), (h, e), (h, e), (1, 0))}

    def layer_tensors(self, c, p, layer):
        if layer[1] not in c.linear.layers:
            return Family.layer_tensors(self, c, p, layer)
        e, h, d, k = c.hidden_size, c.linear.num_value_heads, c.linear.key_head_dim, c.linear.conv_kernel
        a, s = layer + ("attn",), p + "self_attn."
        heads = lambda name: HFTensor(a + (name,), (h * d, e), (h, d, e), (2, 0, 1))  # noqa: E731
        return {
            **self.mlp_tensors(c, p, layer),
            **{p + hf + ".weight": same(layer + (ours, "weight"), (e,)) for ours, hf in self.norm_names.items()},
            **{s + f"{n}_proj.weight": heads(n) for n in "qkvfg"},
            **{s + f"{n}_conv1d.weight": HFTensor(a + ("conv_" + n,), (h * d, 1, k), (h, d, k), (0, 1, 2))
               for n in "qkv"},
            s + "dt_bias": HFTensor(a + ("dt_bias",), (h * d,), (h, d), (0, 1)),
            s + "A_log": same(a + ("a_log",), (h,)),
            s + "b_proj.weight": HFTensor(a + ("b",), (h, e), (h, e), (1, 0)),
            s + "o_norm.weight": same(a + ("norm",), (d,)),
            s + "o_proj.weight": HFTensor(a + ("out",), (e, h * d), (e, h, d), (1, 2, 0)),
        }

    def mlp_tensors(self, c, p, layer):
        if not is_moe_layer(c, layer[1]):
            return Family.mlp_tensors(self, c, p, layer)
        return grouped_sigmoid_moe_tensors(c, p, layer)

    def skipped_prefixes(self, config, hf):
        return DeepseekV3.skipped_prefixes(self, config, hf)


FAMILIES = (BailingHybrid(),)
