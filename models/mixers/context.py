"""The one interface of a layer's mixer: `mixer(x, cache_entry, ctx) -> (y, cache_entry)`.

Attention, latent attention (MLA), Gated DeltaNet and Mamba2 all take the layer's input
rows, their own cache entry (KV pages, latent pages, or a recurrent state) and the step's
shared context, and give back their output rows and the new entry. The decoder layer
(models/decoder.py) calls any of them the same way, so a new mixer is one file that
implements this and one line in `MIXERS` (models/mixers/__init__.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax

from jaxfill.models.kv_cache import AttentionMetadata


@dataclasses.dataclass(frozen=True)
class MixerContext:
    """What every mixer of one step shares; a mixer reads what it needs and ignores the rest
    (a linear rule's state carries positions, so it reads neither `positions` nor `impl`)."""
    positions: jax.Array  # [T] int32
    meta: AttentionMetadata
    impl: str  # the attention kernel (engine.attention_impl): auto | xla | pallas_*
    layer: Any  # this layer's number: a Python int, or traced in a stacked layout
    # the output is only each sequence's sampled row (meta.logits_indices): in the last
    # layer no other row feeds anything (the execution plan's prunes_last_layer)
    sampled_only: bool = False
    per_layer_input: jax.Array | None = None  # [T, L, P] Gemma 4's per-layer inputs (models/per_layer_inputs.py)
    # [T, R/2] int32: the position each rotary frequency turns with (Qwen3-VL's mrope,
    # models/rope.py mrope_positions); None: `positions` for every frequency
    rope_positions: jax.Array | None = None

    def sampled(self, rows: jax.Array) -> jax.Array:  # [T, ...] -> [S, ...] when sampled_only
        return jax.numpy.take(rows, self.meta.logits_indices, axis=0) if self.sampled_only else rows


class Mixer(Protocol):
    def __call__(self,
                 x: jax.Array,  # [T, E]
                 cache_entry: Any,  # this layer's KV pages, latent pages or LinearState
                 ctx: MixerContext,
                 ) -> tuple[jax.Array, Any]:  # [T, E] ([S, E] if ctx.sampled_only), the new entry
        ...
