"""Mamba2, the state-space mixer of Nemotron-H.

Per token: input projections give the gate z [H, P], the convolved channels
x [H, P], B [G, N], C [G, N] (one short causal depthwise convolution with bias over
the three, SiLU) and a raw time step per head; the SSD rule (pallas_kernels/ssd.py;
its chunk loop in XLA, or the Pallas TPU kernel of ssd_tpu.py with model.linear_impl =
pallas_tpu) over an [H, N, P] state, with the D skip; the output times silu(z), then an
RMSNorm over each of the G groups of H / G heads (not per head, not over all: Nemotron-H's
`NemotronHRMSNormGated`), in f32 with the weight applied before the one cast; the
output projection.

Falcon-H1 (models/mixers/parallel_hybrid.py) configures it further through the same
section: muP multipliers on its input, on each projected part (z, x, B, C, dt, before the
convolution) and on its output; the norm before the gate, or no norm (the gate alone);
a bias on the output projection.

The shapes ride on ModelConfig's linear section (models/config/sections.py): key heads = G,
key head dim = N, value heads = H, value head dim = P. What a sequence carries between
steps is its `LinearState` (the state and the convolution's last K-1 inputs), in a
slot per sequence (models/linear_slots.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
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
from jaxfill.pallas_kernels.ssd import ssd_chunked, time_steps
from jaxfill.pallas_kernels.ssd_tpu import ssd_tpu

CONV_PARTS = ("x", "b", "c")  # one group's convolved channels, in order


class Mamba2(nnx.Module):
    """Params split by group so 'tensor' ranks each hold whole groups: group g is its B and
    C and its H / G heads with their x, z, dt, dt_bias, a_log, D, norm and output rows. The
    convolution's channels run group by group, [x_g, B_g, C_g], and so does its state
    (models/linear_state.py), so a rank's share is one contiguous block. The gated RMSNorm
    is per group too: ranks never talk before the output projection's all-reduce."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c, dt = config, config.jnp_dtype
        e, g, n, h, p, k = (c.hidden_size, c.linear.num_key_heads, c.linear.key_head_dim, c.linear.num_value_heads,
                            c.linear.value_head_dim, c.linear.conv_kernel)
        widths, wd = {"x": h // g * p, "b": n, "c": n}, int8_form(c)
        # the projections int8 with their scales, or float (models/quant.py); the depthwise
        # convolutions stay in the model dtype (K values per channel)
        self.z, self.z_scale = mixer_projection(rngs, (e, h, p), ("embed", "q_heads", None), dt, wd, "z")
        for part, w in widths.items():
            weight, scale = mixer_projection(rngs, (e, g, w), ("embed", "kv_heads", None), dt, wd, part)
            setattr(self, part, weight)
            setattr(self, part + "_scale", scale)
            setattr(self, "conv_" + part, param(rngs, (g, w, k), ("kv_heads", None, None), dt, scale=0.3))
            if c.linear.conv_bias:
                setattr(self, "conv_bias_" + part, param(rngs, (g, w), ("kv_heads", None), dt, scale=0.1))
        self.dt, self.dt_scale = mixer_projection(rngs, (e, h), ("embed", "q_heads"), dt, wd, "dt")
        self.dt_bias = param(rngs, (h,), ("q_heads",), dt, init="one_plus_normal", scale=0.1)
        self.a_log = param(rngs, (h,), ("q_heads",), dt, scale=1.0)
        self.d = param(rngs, (h,), ("q_heads",), dt, init="one_plus_normal", scale=0.1)
        self.norm = None if c.linear.gated_norm == "none" else \
            param(rngs, (h, p), ("q_heads", None), dt, init="one_plus_normal", scale=0.1)
        self.out, self.out_scale = mixer_projection(rngs, (h, p, e), ("q_heads", None, "embed"), dt, wd, "out")
        self.out_bias = param(rngs, (e,), ("embed",), dt, scale=0.1) if c.linear.out_bias else None
        self.config = c

    def __call__(self,
                 x: jax.Array,  # [T, E]
                 state: LinearState,
                 ctx: MixerContext,  # model.linear_impl, not ctx.impl, picks the scan's kernel
                 ) -> tuple[jax.Array, LinearState]:  # [T, E] ([S, E] if ctx.sampled_only), state
        c = self.config
        if c.linear.in_scale != 1.0:  # Falcon-H1's ssm_in_multiplier
            x = x * jnp.asarray(c.linear.in_scale, x.dtype)
        z, xs, b, cc, dt = (project(self, name, "te,e...->t...", x) for name in ("z", "x", "b", "c", "dt"))
        if c.linear.part_scales:  # Falcon-H1's muP vector over the in_proj groups, before the convolution
            z, xs, b, cc, dt = (t * jnp.asarray(m, t.dtype) for t, m in zip((z, xs, b, cc, dt), c.linear.part_scales))
        conv = (tuple(getattr(self, "conv_" + part)[...] for part in CONV_PARTS),
                tuple(getattr(self, "conv_bias_" + part)[...] for part in CONV_PARTS) if c.linear.conv_bias else None)
        heads = (self.dt_bias[...], self.a_log[...], self.d[...], None if self.norm is None else self.norm[...])
        y, state = split_over_heads(
            lambda *args: mix(*args, eps=c.norms.eps, dt_limit=c.linear.dt_limit,
                              kernel=c.linear.impl == "pallas_tpu", gated_norm=c.linear.gated_norm),
            (xs, b, cc, z, dt, conv, heads, state, ctx.meta),
            (1, 1, 1, 1, 1, 0, 0, LinearState(1, 1), None), (1, LinearState(1, 1)))
        out = project(self, "out", "thp,hpe->te", ctx.sampled(y))
        if self.out_bias is not None:
            out = out + self.out_bias[...]
        if c.linear.out_scale != 1.0:  # Falcon-H1's ssm_out_multiplier
            out = out * jnp.asarray(c.linear.out_scale, out.dtype)
        return constrain(out, ("tokens", "act_embed")), state  # an all-reduce over 'tensor'


def mix(x: jax.Array,  # [T, G, H/G P]  (one rank's groups throughout)
        b: jax.Array,  # [T, G, N]
        c: jax.Array,  # [T, G, N]
        z: jax.Array,  # [T, H, P]
        dt: jax.Array,  # [T, H] the raw time steps
        conv: tuple,  # weights ([G, H/G P, K], [G, N, K], [G, N, K]), biases ([G, H/G P], [G, N], [G, N]) or None
        heads: tuple,  # dt_bias, a_log, D [H], norm [H, P] (None: gated_norm "none")
        state: LinearState,  # recurrent [slots, H, N, P], conv [slots, G (H/G P + 2N), K-1]
        meta: AttentionMetadata,
        eps: float,
        dt_limit: tuple | None,
        kernel: bool = False,  # the chunk loop as the Pallas TPU kernel (auto: XLA, never measured on TPU)
        gated_norm: str = "after_gate",  # LinearConfig.gated_norm: where the norm sits beside the gate
        ) -> tuple[jax.Array, LinearState]:  # [T, H, P] in the model dtype, the new state
    """Convolution, SSD and gated per-group RMSNorm over a rank's groups."""
    f32, dtype = jnp.float32, x.dtype
    t, g, w = x.shape
    n, (h, p) = b.shape[-1], z.shape[1:]
    seq = token_sequences(meta.cu_q_lens, meta.num_seqs, t)
    read = read_slots(state, meta)

    weights, biases = conv
    width = w + 2 * n  # one group's channels
    weight = jnp.concatenate(weights, axis=1).reshape(g * width, -1)
    bias = None if biases is None else jnp.concatenate(biases, axis=1).reshape(g * width)
    xbc, history = causal_conv(jnp.concatenate([x, b, c], axis=-1).reshape(t, g * width), weight, read.conv,
                               meta.cu_q_lens, seq, bias)
    xbc = jax.nn.silu(xbc.astype(f32)).astype(dtype).reshape(t, g, width)
    xs, b, c = xbc[..., :w].reshape(t, h, p), xbc[..., w:w + n], xbc[..., w + n:]
    dt_bias, a_log, d, norm = heads
    a = -jnp.exp(a_log.astype(f32))
    scan = ssd_tpu if kernel else ssd_chunked
    y, recurrent = scan(xs, time_steps(dt, dt_bias, dt_limit), a, b, c, d, meta.cu_q_lens, meta.num_seqs,
                        read.recurrent)

    gate = jax.nn.silu(z.astype(f32))
    if gated_norm == "none":  # Falcon-H1 without mamba_rms_norm: the gate alone
        return (y * gate).astype(dtype), write_slots(state, read, recurrent, history)
    # RMSNorm over each group of h / g heads, in f32, the weight before the cast; the gate
    # before it (Nemotron-H, Granite) or after it (Falcon-H1's mamba_norm_before_gate)
    if gated_norm == "after_gate":
        y = y * gate
    y = y.reshape(t, g, w)
    y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + eps)
    y = norm.astype(f32) * y.reshape(t, h, p)
    if gated_norm == "before_gate":
        y = y * gate
    return y.astype(dtype), write_slots(state, read, recurrent, history)
