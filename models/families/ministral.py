"""Ministral (MinistralForCausalLM: Ministral-8B-2410): Mistral's layer with a window per
layer (`layer_types`; without it every layer slides when `sliding_window` is set).

Ministral 3 (Ministral3ForCausalLM): Mistral's layer whose queries, after rope, are scaled
by position: q * (1 + beta * log(1 + floor(position / L))), beta the rope parameters'
`llama_4_scaling_beta` and L their `original_max_position_embeddings` (transformers'
`get_llama_4_attn_scale`; both must be there, as transformers reads them unconditionally)."""

from __future__ import annotations

from jaxfill.models.config import ConfigError
from jaxfill.models.families.base import FAMILY_TESTED, Family, activation, layer_types_from, window_fields


class Ministral(Family):
    name = "ministral"
    architectures = ("MinistralForCausalLM",)
    honoured = frozenset({"hidden_act", "sliding_window", "layer_types"})
    rope_types = ("default", "linear", "llama3", "yarn")
    tested = FAMILY_TESTED

    def model_fields(self, hf):
        layers, window = hf["num_hidden_layers"], hf.get("sliding_window")
        types = layer_types_from(hf, layers) or ("sliding" if window else "full",) * layers
        return dict(hidden_act=activation(hf), **window_fields(types, window))


# Keys of Ministral 3's rope_parameters that are no rope setting
TEMPERATURE_KEYS = ("llama_4_scaling_beta", "max_position_embeddings")


class Ministral3(Family):
    name = "ministral3"
    architectures = ("Ministral3ForCausalLM",)
    honoured = frozenset({"hidden_act", "sliding_window"})
    rope_types = ("default", "linear", "llama3", "yarn")
    tested = FAMILY_TESTED

    def model_fields(self, hf):
        rope = hf.get("rope_parameters") or {}
        beta, length = rope.get("llama_4_scaling_beta"), rope.get("original_max_position_embeddings")
        if beta is None or not length:
            raise ConfigError("config.json rope_parameters of ministral3 need llama_4_scaling_beta and "
                              f"original_max_position_embeddings (got {beta!r}, {length!r})")
        return dict(hidden_act=activation(hf), sliding_window=hf.get("sliding_window") or None,
                    query_temperature_beta=float(beta), query_temperature_length=int(length))

    def rope(self, hf, rope=None):
        rope = rope if rope is not None else (hf.get("rope_parameters") or {})
        return super().rope(hf, {k: v for k, v in rope.items() if k not in TEMPERATURE_KEYS})


FAMILIES = (Ministral(), Ministral3())
