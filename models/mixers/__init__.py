"""Layer mixers: each implements `mixer(x, cache_entry, ctx) -> (y, cache_entry)`
(models/mixers/context.py). `MIXERS` names them as the capability table and the families'
`mixers` do (engine/capabilities/table.py)."""

from __future__ import annotations

from jaxfill.models.mixers.attention import Attention
from jaxfill.models.mixers.context import Mixer, MixerContext
from jaxfill.models.mixers.gated_deltanet import GatedDeltaNet
from jaxfill.models.mixers.kda import KimiDeltaAttention
from jaxfill.models.mixers.mamba2 import Mamba2
from jaxfill.models.mixers.mla import LatentAttention
from jaxfill.models.mixers.parallel_hybrid import ParallelHybrid
from jaxfill.models.mixers.short_conv import ShortConv

MIXERS = {"attention": Attention, "mla": LatentAttention, "gated_deltanet": GatedDeltaNet, "mamba2": Mamba2,
          "short_conv": ShortConv, "kda": KimiDeltaAttention, "parallel_hybrid": ParallelHybrid}


def mixer_kind(config, layer: int) -> str | None:
    """Layer `layer`'s mixer, by its MIXERS name; None in an MLP-only layer."""
    if layer in config.no_mixer_layers:
        return None
    if layer in config.linear.layers:  # Falcon-H1's run attention beside the linear mixer
        return "parallel_hybrid" if config.linear.parallel else config.linear.kind
    return "mla" if config.mla.enabled else "attention"


def build_mixer(config, rngs, layer: int) -> Mixer | None:
    kind = mixer_kind(config, layer)
    if kind in ("attention", "parallel_hybrid"):  # shapes may be the layer's own (ModelConfig.attention_dims)
        return MIXERS[kind](config, rngs, layer)
    return None if kind is None else MIXERS[kind](config, rngs)


__all__ = ["Attention", "GatedDeltaNet", "KimiDeltaAttention", "LatentAttention", "Mamba2", "Mixer", "MixerContext",
           "MIXERS", "ParallelHybrid", "ShortConv", "build_mixer", "mixer_kind"]
