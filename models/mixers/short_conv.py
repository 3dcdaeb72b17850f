"""LFM2's gated short convolution, the linear mixer of LFM2 and LFM2-MoE.

Per token: one input projection gives three hidden-size vectors B, C and x; B * x runs
through a causal depthwise convolution of kernel `linear_conv_kernel` (LFM2's
conv_L_cache, no activation), and C gates its output before the output projection.
With `linear_conv_bias` (LFM2's conv_bias) the input projection, the convolution and the
output projection all add a bias.

There is no recurrent rule: what a sequence carries between steps is the convolution's
last K-1 inputs alone, a `LinearState` whose recurrent array is empty, in the same slots,
snapshots and prefix caching as the other linear mixers (models/linear_slots.py), and
the same ragged convolution (models/causal_conv.py), so a prefill cut into chunks
continues exactly from its slot.
"""

from __future__ import annotations

import jax
from flax import nnx

from jaxfill.models.causal_conv import causal_conv
from jaxfill.models.config import ModelConfig
from jaxfill.models.kv_cache import AttentionMetadata
from jaxfill.models.layers import int8_form, mixer_projection, param, project
from jaxfill.models.linear_slots import read_slots, write_slots
from jaxfill.models.linear_state import LinearState
from jaxfill.models.mixers.context import MixerContext
from jaxfill.models.parallel.heads import split_over_heads
from jaxfill.models.sharding import constrain
from jaxfill.pallas_kernels.ragged_scan import token_sequences

IN_PARTS = ("b", "c", "x")  # the input projection's three parts, in the checkpoint's row order


class ShortConv(nnx.Module):
    """Params split by channel ('mlp', like an MLP's columns): every channel of B, C, x,
    the convolution and the output projection's rows is independent of the others until
    the output projection, so 'tensor' ranks each take a contiguous block of channels and
    of the conv history, and one all-reduce ends the layer."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c, dt = config, config.jnp_dtype
        e, k = c.hidden_size, c.linear.conv_kernel
        wd = int8_form(c)
        for part in IN_PARTS:  # int8 with their scales, or float (models/quant.py)
            w, scale = mixer_projection(rngs, (e, e), ("embed", "mlp"), dt, wd, part)
            setattr(self, part, w)
            setattr(self, part + "_scale", scale)
        self.conv = param(rngs, (e, k), ("mlp", None), dt, scale=0.3)  # K values per channel: kept in the model dtype
        self.out, self.out_scale = mixer_projection(rngs, (e, e), ("mlp", "embed"), dt, wd, "out")
        if c.linear.conv_bias:
            for part in IN_PARTS:
                setattr(self, part + "_bias", param(rngs, (e,), ("mlp",), dt, scale=0.1))
            self.conv_bias = param(rngs, (e,), ("mlp",), dt, scale=0.1)
            self.out_bias = param(rngs, (e,), ("embed",), dt, scale=0.1)
        self.config = c

    def __call__(self,
                 x: jax.Array,  # [T, E]
                 state: LinearState,
                 ctx: MixerContext,
                 ) -> tuple[jax.Array, LinearState]:  # [T, E] ([S, E] if ctx.sampled_only), state
        bias = self.config.linear.conv_bias

        def proj(part):  # [T, E] channels
            y = project(self, part, "te,ec->tc", x)
            return y + getattr(self, part + "_bias")[...] if bias else y

        b, c, xs = (proj(part) for part in IN_PARTS)
        conv_bias = self.conv_bias[...] if bias else None
        y, state = split_over_heads(mix, (b, c, xs, self.conv[...], conv_bias, state, ctx.meta),
                                    (1, 1, 1, 0, 0, LinearState(1, 1), None), (1, LinearState(1, 1)))
        out = project(self, "out", "tc,ce->te", ctx.sampled(y))
        out = constrain(out, ("tokens", "act_embed"))  # an all-reduce over 'tensor'
        return (out + self.out_bias[...] if bias else out), state


def mix(b: jax.Array,  # [T, C]  (one rank's channels throughout)
        c: jax.Array,  # [T, C]
        x: jax.Array,  # [T, C]
        weight: jax.Array,  # [C, K]
        bias: jax.Array | None,  # [C]
        state: LinearState,  # recurrent [slots, 0] (none), conv [slots, C, K-1]
        meta: AttentionMetadata,
        ) -> tuple[jax.Array, LinearState]:  # [T, C], the new state
    """C * conv(B * x), the convolution continuing each sequence's history from its slot."""
    seq = token_sequences(meta.cu_q_lens, meta.num_seqs, b.shape[0])
    read = read_slots(state, meta)
    y, history = causal_conv(b * x, weight, read.conv, meta.cu_q_lens, seq, bias)
    return c * y, write_slots(state, read, read.recurrent, history)
