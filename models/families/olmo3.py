"""OLMo 3: OLMo 2's layer (post-norms only, q/k RMSNorms over the whole projection, norms
multiplying in f32) with sliding-window layers (`layer_types`, by default three sliding
to one full) and a rope per layer type: transformers 5 writes `rope_parameters` as
{"sliding_attention": ..., "full_attention": ...}; a transformers-4 file's `rope_scaling`
(YaRN in the released 7B/32B) turns the full layers only, the sliding ones keep the plain
rope of `rope_theta`."""

from __future__ import annotations

from jaxfill.models.config import ConfigError, freeze
from jaxfill.models.families.base import layer_type_ropes, layer_types_from, window_fields
from jaxfill.models.families.olmo2 import Olmo2


class Olmo3(Olmo2):
    name = "olmo3"
    architectures = ("Olmo3ForCausalLM",)
    honoured = Olmo2.honoured | {"sliding_window", "layer_types"}

    def model_fields(self, hf):
        layers = hf["num_hidden_layers"]
        types = layer_types_from(hf, layers) or tuple(
            "full" if (n + 1) % 4 == 0 else "sliding" for n in range(layers))
        per_type = layer_type_ropes(self, hf)
        if per_type:
            theta, scaling, local_theta = per_type
        else:  # transformers 4: rope_scaling is the full layers' alone
            theta, scaling = self.rope(hf)
            local_theta = theta
        window = window_fields(types, hf.get("sliding_window"))
        sliding = window["sliding_window"] is not None
        if "sliding" in types and not sliding and (scaling or local_theta != theta):
            raise ConfigError("olmo3: sliding layers without a sliding_window but with their own rope "
                              "are not supported")
        return dict(super().model_fields(hf), rope_theta=float(theta),
                    rope_scaling=freeze(scaling) if scaling else None,
                    # the sliding layers' own rope, where it differs from the full layers'
                    rope_local_theta=float(local_theta) if sliding and (scaling or local_theta != theta) else None,
                    **window)

    def common_fields(self, hf):
        if layer_type_ropes(self, hf):  # read in model_fields
            hf = {k: v for k, v in hf.items() if k != "rope_parameters"}
        return super().common_fields(hf)


FAMILIES = (Olmo3(),)
