"""Llama 4 (Llama4ForCausalLM, and the text tower of Llama4ForConditionalGeneration).

Llama's pre-norm layer with rope on (even, odd) pairs (transformers turns q and k as
complex numbers, in f32) and three departures:
- every `no_rope_layer_interval`-th layer (or where `no_rope_layers[n]` is 0) has no rope
  and attends globally; the others attend within fixed chunks of `attention_chunk_size`
  positions ("chunked": a row sees only keys of its own chunk, the kernels' mask kind of
  pallas_kernels/ragged_paged_attention/window.py) and, with `use_qk_norm`, RMS-norm q and
  k per head without a weight after rope;
- on the NoPE layers queries are scaled by 1 + attn_scale * log(1 + floor((position + 1) /
  floor_scale)) (`attn_temperature_tuning`);
- `moe_layers` (else every `interleave_moe_layer_step`-th layer) are a mixture of experts:
  the top k of the router logits, each weighted by the sigmoid of its logit, the weight
  multiplying the expert's input, beside an ungated shared expert; the other layers' MLP
  has `intermediate_size_mlp`, the experts' and the shared expert's `intermediate_size`.
"""

from __future__ import annotations

from jaxfill.models.config import ConfigError
from jaxfill.models.families.base import Family, HFTensor, activation, head_under, same, text_tower_config
from jaxfill.models.families.experts import shared_expert_tensors
from jaxfill.models.moe import is_moe_layer

LAYER_TYPES = {"full_attention": "full", "chunked_attention": "chunked"}
TESTED = ("HF f32 logits and greedy tokens (chunks of 32 under the 64- and 300-token prompts, NoPE layers with a "
          "binding temperature, weightless q/k norms, sigmoid experts weighting their inputs, a shared expert, "
          "dense layers between sparse ones); through the Engine chunked = whole = prefix-cached = expert 4 = "
          "expert 2 x tensor 2 = sequence 2")


def uses_rope(hf, layers: int) -> list[int]:
    """transformers' no_rope_layers: 1 where layer n turns rope."""
    flags = hf.get("no_rope_layers") or [int((n + 1) % hf.get("no_rope_layer_interval", 4) != 0)
                                         for n in range(layers)]
    if len(flags) < layers:
        raise ConfigError(f"config.json no_rope_layers has {len(flags)} entries for {layers} layers")
    return [int(f) for f in flags[:layers]]


def layer_types(hf, rope: list[int]) -> tuple[str, ...]:
    chunk = hf.get("attention_chunk_size", 8192)
    types = hf.get("layer_types") or ["chunked_attention" if r and chunk is not None else "full_attention"
                                      for r in rope]
    bad = sorted(set(types) - set(LAYER_TYPES))
    if bad or len(types) != len(rope):
        raise ConfigError(f"config.json layer_types {types} are not supported for llama4 "
                          f"(one of {sorted(LAYER_TYPES)} per layer)")
    if "chunked_attention" in types and chunk is None:
        raise ConfigError("config.json layer_types has chunked_attention layers but attention_chunk_size is null")
    return tuple(LAYER_TYPES[t] for t in types)


class Llama4(Family):
    name = "llama4"
    architectures = ("Llama4ForCausalLM",)
    honoured = frozenset({"hidden_act", "attention_bias", "intermediate_size_mlp", "no_rope_layers",
                          "no_rope_layer_interval", "attention_chunk_size", "layer_types", "use_qk_norm",
                          "attn_temperature_tuning", "floor_scale", "attn_scale", "num_local_experts",
                          "num_experts_per_tok", "moe_layers", "interleave_moe_layer_step"})
    # training only (the router adds no jitter at inference; aux loss, router logits out)
    inert = frozenset({"router_aux_loss_coef", "output_router_logits", "router_jitter_noise"})
    rope_types = ("default", "linear", "llama3")
    experts = True
    tested = TESTED
    norm_names = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}

    def model_fields(self, hf):
        layers = hf["num_hidden_layers"]
        rope = uses_rope(hf, layers)
        types = layer_types(hf, rope)
        step = int(hf.get("interleave_moe_layer_step") or 1)
        moe = hf.get("moe_layers")
        moe = set(range(step - 1, layers, step) if moe is None else moe)
        bias = bool(hf.get("attention_bias", False))
        tuning = hf.get("attn_temperature_tuning", True)
        chunk = hf.get("attention_chunk_size", 8192) if "chunked" in types else None
        qk_norm = bool(hf.get("use_qk_norm", True))
        return dict(
            self.model_defaults(hf["hidden_size"]), hidden_act=activation(hf),
            intermediate_size=int(hf.get("intermediate_size_mlp", 16384)),
            attention_bias=bias, attention_out_bias=bias,
            nope_layers=tuple(n for n, r in enumerate(rope) if not r),
            layer_types=types if len(set(types)) > 1 else (),
            attention_chunk=int(chunk) if chunk else None,
            qk_norm="weightless" if qk_norm else "none", qk_norm_after_rope=qk_norm,
            query_temperature_beta=float(hf.get("attn_scale", 0.1)) if tuning else 0.0,
            query_temperature_length=int(hf.get("floor_scale", 8192)) if tuning else 0,
            num_experts=int(hf.get("num_local_experts", 16)), experts_per_token=int(hf.get("num_experts_per_tok", 1)),
            moe_intermediate_size=int(hf["intermediate_size"]), shared_expert_size=int(hf["intermediate_size"]),
            dense_layers=tuple(n for n in range(layers) if n not in moe))

    def model_defaults(self, hidden_size):
        return dict(rope_interleave=True, rope_f32=True, qk_norm="weightless", qk_norm_after_rope=True,
                    query_temperature_offset=1, query_temperature_nope_only=True, query_temperature_beta=0.1,
                    query_temperature_length=8192, router_scoring="sigmoid", router_renormalize=False,
                    router_weights_inputs=True, num_experts=16, experts_per_token=1,
                    moe_intermediate_size=hidden_size, shared_expert_size=hidden_size)

    def mlp_tensors(self, c, p, layer):
        e, h, i = c.moe.num_experts, c.hidden_size, c.moe.intermediate_size
        m, f = layer + ("mlp",), p + "feed_forward."
        if not is_moe_layer(c, layer[1]):
            return {f"{f}{name}.weight": HFTensor(m + (ours,), shape, shape, (1, 0)) for name, ours, shape in (
                ("gate_proj", "gate", (c.intermediate_size, h)), ("up_proj", "up", (c.intermediate_size, h)),
                ("down_proj", "down", (h, c.intermediate_size)))}
        return {
            f + "router.weight": HFTensor(m + ("router",), (e, h), (e, h), (1, 0)),
            # [E, H, 2I]: gate columns, then up columns -> [E, H, 2, I]
            f + "experts.gate_up_proj": HFTensor(m + ("experts_gate_up",), (e, h, 2 * i), (e, h, 2, i),
                                                 (0, 1, 2, 3)),
            f + "experts.down_proj": same(m + ("experts_down",), (e, i, h)),
            **shared_expert_tensors(c, p, layer, block="feed_forward", gate=None),
        }


class Llama4Multimodal(Llama4):
    """The text tower of the image-text checkpoint; the vision model and projector are skipped."""
    architectures = ("Llama4ForConditionalGeneration",)
    prefix = "language_model.model."
    ignored_prefixes = ("vision_model.", "multi_modal_projector.")
    tested = "HF parity f32 of the text tower (text-only prompts), vision weights skipped"

    def to_model_config(self, hf, architecture):
        text = text_tower_config(hf, "Llama4ForConditionalGeneration", tie_default=False)
        return super().to_model_config(text, architecture)

    def tensors(self, config):
        return head_under(super().tensors(config), "language_model.")


FAMILIES = (Llama4(), Llama4Multimodal())
