"""SmolLM3: Llama's layer; every `no_rope_layer_interval`-th layer has no rotary embedding
(`no_rope_layers[n]` is 1 where layer n uses rope)."""

from __future__ import annotations

from jaxfill.models.config import ConfigError
from jaxfill.models.families.base import (
    FAMILY_TESTED, SLIDING_DEPENDS, Family, activation, sliding_layers, window_fields,
)


class SmolLM3(Family):
    name = "smollm3"
    architectures = ("SmolLM3ForCausalLM",)
    honoured = frozenset({"hidden_act", "attention_bias", "no_rope_layers", "no_rope_layer_interval",
                          "use_sliding_window", "sliding_window", "layer_types", "max_window_layers"})
    depends = SLIDING_DEPENDS
    fixed = {"mlp_bias": False}
    tested = FAMILY_TESTED

    def model_fields(self, hf):
        layers = hf["num_hidden_layers"]
        uses_rope = hf.get("no_rope_layers")
        if uses_rope is None:
            interval = hf.get("no_rope_layer_interval", 4)
            uses_rope = [int((n + 1) % interval != 0) for n in range(layers)]
        if len(uses_rope) != layers:
            raise ConfigError(f"config.json no_rope_layers has {len(uses_rope)} entries for {layers} layers")
        bias = bool(hf.get("attention_bias", False))
        types = sliding_layers(hf, layers)
        return dict(hidden_act=activation(hf), attention_bias=bias, attention_out_bias=bias,
                    nope_layers=tuple(n for n, use in enumerate(uses_rope) if not use),
                    **window_fields(types, hf.get("sliding_window")))


FAMILIES = (SmolLM3(),)
