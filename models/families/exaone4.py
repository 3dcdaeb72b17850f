"""EXAONE 4 (Exaone4ForCausalLM): OLMo 2's layer order (norms after attention and after the
MLP only) with Llama's RMSNorm, q/k RMSNorms per head before rope, and sliding and full
layers (`layer_types`; without it every `sliding_window_pattern`-th layer is full). With a
window, the full layers have no rotary embedding ("global NoPE"); without one
(`sliding_window` null) every layer is full and turns."""

from __future__ import annotations

from jaxfill.models.config import ConfigError
from jaxfill.models.families.base import FAMILY_TESTED, Family, activation, layer_types_from, window_fields


class Exaone4(Family):
    name = "exaone4"
    architectures = ("Exaone4ForCausalLM",)
    honoured = frozenset({"hidden_act", "sliding_window", "sliding_window_pattern", "layer_types"})
    norm_names = {"attn_post_norm": "post_attention_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}
    tested = FAMILY_TESTED

    def model_fields(self, hf):
        layers, window = hf["num_hidden_layers"], hf.get("sliding_window")
        types = layer_types_from(hf, layers) or self.pattern_types(hf, layers)
        nope = tuple(n for n, t in enumerate(types) if t == "full") if window else ()
        return dict(self.model_defaults(hf["hidden_size"]), hidden_act=activation(hf), nope_layers=nope,
                    **window_fields(types, window))

    def pattern_types(self, hf, layers: int) -> tuple[str, ...]:
        """transformers' layer_types from an int `sliding_window_pattern` (every p-th layer
        full), when the file spells no layer_types out."""
        if not hf.get("sliding_window"):
            return ("full",) * layers
        pattern = hf.get("sliding_window_pattern", 4)
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern <= 0:
            # transformers 5 derives layer_types from an int pattern only (a string like "LLLG" fails there)
            raise ConfigError(f"config.json sliding_window_pattern={pattern!r} without layer_types is not "
                              "supported for exaone4 (only a positive int)")
        return tuple("full" if (n + 1) % pattern == 0 else "sliding" for n in range(layers))

    def model_defaults(self, hidden_size):
        return dict(norm_layout="post", qk_norm="head")


FAMILIES = (Exaone4(),)
