"""Attention and Mamba2 side by side on one layer's input (Falcon-H1).

Each Falcon-H1 layer feeds the same normed rows to both mixers and adds their outputs
before the residual; neither reads the other. So the mixer is the two existing ones
composed: attention (models/mixers/attention.py, with its in / key / out multipliers)
over the layer's KV pages, Mamba2 (models/mixers/mamba2.py, with its in / muP / out
multipliers) over the layer's state slot. The layer's cache entry holds both, a
`PagesAndState` (models/linear_state.py), and comes back as one.
"""

from __future__ import annotations

import jax
from flax import nnx

from jaxfill.models.config import ModelConfig
from jaxfill.models.linear_state import PagesAndState
from jaxfill.models.mixers.attention import Attention
from jaxfill.models.mixers.context import MixerContext
from jaxfill.models.mixers.mamba2 import Mamba2


class ParallelHybrid(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, layer: int = 0):
        self.attention = Attention(config, rngs, layer)
        self.mamba = Mamba2(config, rngs)

    def __call__(self,
                 x: jax.Array,  # [T, E] the layer's normed input
                 entry: PagesAndState,  # pages [num_pages, page_size, 2 * Hkv, D], state (LinearState)
                 ctx: MixerContext,
                 ) -> tuple[jax.Array, PagesAndState]:  # [T, E] ([S, E] if ctx.sampled_only), the new entry
        ssm, state = self.mamba(x, entry.state, ctx)
        attn, pages = self.attention(x, entry.pages, ctx)
        return ssm + attn, PagesAndState(pages, state)
