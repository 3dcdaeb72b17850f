"""Llama 2/3/3.1 (and Llama-shaped exports), Mistral and Qwen2: pre-norm, SwiGLU, GQA."""

from __future__ import annotations

from jaxfill.models.families.base import SLIDING_DEPENDS, Family, activation, sliding_layers, window_fields


class Llama(Family):
    name = "llama"
    architectures = ("LlamaForCausalLM",)
    honoured = frozenset({"hidden_act", "attention_bias"})
    inert = frozenset({"pretraining_tp"})  # a training-time split of the same matmuls
    fixed = {"mlp_bias": False}
    rope_types = ("default", "linear", "llama3", "yarn")
    tested = "HF f32/bf16 logits and greedy tokens; every layout, quantization and server test of the suite"

    def model_fields(self, hf):
        bias = bool(hf.get("attention_bias", False))  # HF biases q, k, v and o
        return dict(hidden_act=activation(hf), attention_bias=bias, attention_out_bias=bias)


class Mistral(Llama):
    name = "mistral"
    architectures = ("MistralForCausalLM",)
    honoured = frozenset({"hidden_act", "sliding_window"})
    fixed = {}
    tested = "HF f32/bf16 logits and greedy tokens (window shorter than the prompts)"

    def model_fields(self, hf):
        return dict(hidden_act=activation(hf), sliding_window=hf.get("sliding_window") or None)


class Qwen2(Llama):
    name = "qwen2"
    architectures = ("Qwen2ForCausalLM",)
    honoured = frozenset({"hidden_act", "sliding_window", "use_sliding_window", "max_window_layers",
                          "layer_types"})
    depends = SLIDING_DEPENDS
    fixed = {}
    tested = "HF f32/bf16 logits and greedy tokens (q/k/v biases, tied head); int8 weights"

    def model_fields(self, hf):
        types = sliding_layers(hf, hf["num_hidden_layers"])
        return dict(self.model_defaults(hf["hidden_size"]), hidden_act=activation(hf),
                    **window_fields(types, hf.get("sliding_window")))

    def model_defaults(self, hidden_size):
        return dict(attention_bias=True)


FAMILIES = (Llama(), Mistral(), Qwen2())
