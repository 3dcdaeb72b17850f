"""gpt-oss (GptOssForCausalLM): attention with q/k/v/o biases and a learned sink logit per
head, sliding (128) and full layers alternating, YaRN rope; every MLP a mixture of experts
routed by top k of biased logits then a softmax over those k, experts with biases and a
clamped SwiGLU. HF stores the experts fused, [E, H, 2I] with gate and up interleaved
column by column; the published checkpoints hold them as MXFP4 blocks and scales, which
load dequantized (models/mxfp4.py) to the model dtype, or to int8 with weight_dtype=int8."""

from __future__ import annotations

from jaxfill.models.config import ConfigError
from jaxfill.models.families.base import Family, HFTensor, layer_types_from, same, window_fields

TESTED = ("HF f32 logits and greedy tokens (sinks, alternating windows, YaRN, biased experts, clamped "
          "SwiGLU); MXFP4 experts load to the values they encode; through the Engine chunked = prefix-cached "
          "= expert 2 x tensor 2 = one device")


class GptOss(Family):
    name = "gpt_oss"
    architectures = ("GptOssForCausalLM",)
    honoured = frozenset({"attention_bias", "num_local_experts", "num_experts_per_tok", "experts_per_token",
                          "swiglu_limit", "swiglu_alpha", "sliding_window", "layer_types", "quantization_config"})
    # hidden_act is stored but the experts' clamped SwiGLU never reads it; initial_context_length
    # is the rope's original context, given again in rope_parameters
    inert = frozenset({"router_aux_loss_coef", "output_router_logits", "hidden_act", "initial_context_length"})
    experts = True
    tested = TESTED

    def model_fields(self, hf):
        layers = hf["num_hidden_layers"]
        k = hf.get("num_experts_per_tok", hf.get("experts_per_token"))
        if hf.get("experts_per_token") not in (None, k):
            raise ConfigError(f"config.json experts_per_token={hf['experts_per_token']} and "
                              f"num_experts_per_tok={k} disagree")
        quant = hf.get("quantization_config") or {}
        if quant and quant.get("quant_method") != "mxfp4":
            raise ConfigError(f"gpt_oss: quantization_config quant_method={quant.get('quant_method')!r} is not "
                              "supported (only mxfp4 experts, dequantized at load)")
        types = layer_types_from(hf, layers) or tuple("sliding" if n % 2 == 0 else "full" for n in range(layers))
        bias = bool(hf.get("attention_bias", True))
        limit = hf.get("swiglu_limit", 7.0)
        return dict(self.model_defaults(hf["hidden_size"]), attention_bias=bias, attention_out_bias=bias,
                    num_experts=int(hf["num_local_experts"]), experts_per_token=int(k),
                    moe_intermediate_size=hf["intermediate_size"],
                    swiglu_limit=None if limit is None else float(limit),
                    swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                    **window_fields(types, hf.get("sliding_window", 128)))

    def model_defaults(self, hidden_size):
        return dict(attention_bias=True, attention_out_bias=True, attention_sinks=True, num_experts=8,
                    experts_per_token=2, moe_intermediate_size=hidden_size, router_scoring="topk_softmax",
                    router_renormalize=False, router_logit_bias=True, expert_bias=True, swiglu_limit=7.0)

    def attention_tensors(self, c, p, layer):
        table = super().attention_tensors(c, p, layer)
        table[p + "self_attn.sinks"] = same(layer + ("attn", "sinks"), (c.num_heads,))
        return table

    def mlp_tensors(self, c, p, layer):
        e, h, i = c.moe.num_experts, c.hidden_size, c.moe.intermediate_size
        m, x = layer + ("mlp",), f"{p}mlp.experts."
        return {
            f"{p}mlp.router.weight": HFTensor(m + ("router",), (e, h), (e, h), (1, 0)),
            f"{p}mlp.router.bias": same(m + ("router_logit_bias",), (e,)),
            # gate and up interleaved: column 2j is gate j, 2j + 1 is up j -> [E, H, 2, I]
            x + "gate_up_proj": HFTensor(m + ("experts_gate_up",), (e, h, 2 * i), (e, h, i, 2), (0, 1, 3, 2)),
            x + "gate_up_proj_bias": HFTensor(m + ("experts_gate_up_bias",), (e, 2 * i), (e, i, 2), (0, 2, 1)),
            x + "down_proj": same(m + ("experts_down",), (e, i, h)),
            x + "down_proj_bias": same(m + ("experts_down_bias",), (e, h)),
        }


FAMILIES = (GptOss(),)
