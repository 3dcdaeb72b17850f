"""Kimi Delta Attention (KDA), the linear-attention layer of Kimi Linear.

Gated DeltaNet (models/mixers/gated_deltanet.py) with a decay per key channel: per token,
q, k, v from their own projections through a short causal depthwise convolution (kernel
`linear_conv_kernel`, SiLU), q and k l2-normalised (q also / sqrt(D)); a log decay per
head and key channel, g = -exp(A_log_h) softplus(f_b(f_a(x)) + dt_bias) (a rank-D
bottleneck), and a write strength beta = sigmoid(b) per head; the Kimi delta rule
(pallas_kernels/kimi_delta_rule.py) over a [H, D, D] state; an RMSNorm per head gated by
sigmoid(g_b(g_a(x))) (another rank-D bottleneck); the output projection. Every head has
its own q, k and v (Hk = Hv = H, Dk = Dv = D in LinearConfig's terms).

What a sequence carries between steps is Gated DeltaNet's (`LinearState`, in a slot per
sequence): the recurrent state and the convolution's last `kernel - 1` inputs, channels
head by head [q_h, k_h, v_h], so a 'tensor' rank's share is one contiguous block.
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
from jaxfill.pallas_kernels.kimi_delta_rule import kimi_delta_rule_chunked
from jaxfill.pallas_kernels.ragged_scan import token_sequences

L2_EPS = 1e-6  # transformers' KDA l2norm: x / sqrt(sum(x^2) + eps), flash-linear-attention's spelling
SOFTPLUS_LINEAR = 20.0  # transformers' forget gate: softplus(x) = x above this


def _l2norm(x: jax.Array) -> jax.Array:  # [..., D] f32
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def log_decay(f: jax.Array,  # [T, H, D] the forget gate's projection in the model dtype
              a_log: jax.Array,  # [H]
              dt_bias: jax.Array,  # [H, D]
              lower_bound: float | None = None,
              ) -> jax.Array:  # [T, H, D] f32, <= 0
    """Kimi's -exp(A_log) softplus(f + dt_bias); with `lower_bound` (Ling 2.5's safe
    gate) bound * sigmoid(exp(A_log) (f + dt_bias)), cast to the model dtype as
    transformers' forget gate returns it."""
    g = f.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    if lower_bound is not None:
        bounded = lower_bound * jax.nn.sigmoid(jnp.exp(a_log.astype(jnp.float32))[:, None] * g)
        return bounded.astype(f.dtype).astype(jnp.float32)
    softplus = jnp.where(g > SOFTPLUS_LINEAR, g, jnp.log(1.0 + jnp.exp(jnp.minimum(g, SOFTPLUS_LINEAR))))
    return -jnp.exp(a_log.astype(jnp.float32))[:, None] * softplus


class KimiDeltaAttention(nnx.Module):
    """Params split by head over 'tensor' (every head is alike); the two bottlenecks'
    first halves (f_a, g_a: E -> D) are replicated. With `linear_full_rank_gates` (Ling
    2.5) the gates are one E -> H x D matrix each (f, g), split by head too."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c, dt = config, config.jnp_dtype
        e, h, d, k = c.hidden_size, c.linear.num_value_heads, c.linear.key_head_dim, c.linear.conv_kernel
        heads, wd = ("embed", "q_heads", None), int8_form(c)

        def projection(name, shape, axes, init_scale=0.02):  # int8 with its scales, or float (models/quant.py)
            w, scale = mixer_projection(rngs, shape, axes, dt, wd, name, init_scale)
            setattr(self, name, w)
            setattr(self, name + "_scale", scale)

        for name in ("q", "k", "v"):
            projection(name, (e, h, d), heads)
        # the depthwise convolutions stay in the model dtype: K values per channel
        self.conv_q, self.conv_k, self.conv_v = (param(rngs, (h, d, k), ("q_heads", None, None), dt, scale=0.3)
                                                 for _ in range(3))
        if c.linear.full_rank_gates:
            projection("f", (e, h, d), heads)
            projection("g", (e, h, d), heads)
        else:
            projection("f_a", (e, d), ("embed", None))
            projection("f_b", (d, h, d), (None, "q_heads", None), 0.3)
            projection("g_a", (e, d), ("embed", None))
            projection("g_b", (d, h, d), (None, "q_heads", None), 0.3)
        self.dt_bias = param(rngs, (h, d), ("q_heads", None), dt, init="one_plus_normal", scale=0.1)
        self.a_log = param(rngs, (h,), ("q_heads",), dt, scale=1.0)
        projection("b", (e, h), ("embed", "q_heads"))
        self.norm = param(rngs, (d,), (None,), dt, init="one_plus_normal", scale=0.1)
        projection("out", (h, d, e), ("q_heads", None, "embed"))
        self.config = c

    def __call__(self,
                 x: jax.Array,  # [T, E]
                 state: LinearState,
                 ctx: MixerContext,
                 ) -> tuple[jax.Array, LinearState]:  # [T, E] ([S, E] if ctx.sampled_only), state
        proj = lambda name: project(self, name, "te,e...->t...", x)  # noqa: E731
        q, k, v, b = proj("q"), proj("k"), proj("v"), proj("b")
        if self.config.linear.full_rank_gates:
            f, gate = proj("f"), proj("g")  # [T, H, D] each
        else:  # the rank-D bottlenecks, [T, D] between their halves
            f = project(self, "f_b", "td,dhk->thk", proj("f_a"))  # [T, H, D]
            gate = project(self, "g_b", "td,dhk->thk", proj("g_a"))  # [T, H, D]
        conv = (self.conv_q[...], self.conv_k[...], self.conv_v[...])
        o, state = split_over_heads(
            lambda *args: mix(*args, eps=self.config.norms.eps, lower_bound=self.config.linear.gate_lower_bound),
            (q, k, v, f, b, gate, conv, (self.a_log[...], self.dt_bias[...]), self.norm[...], state, ctx.meta),
            (1, 1, 1, 1, 1, 1, 0, 0, None, LinearState(1, 1), None), (1, LinearState(1, 1)))
        out = project(self, "out", "thd,hde->te", ctx.sampled(o))
        return constrain(out, ("tokens", "act_embed")), state  # an all-reduce over 'tensor'


def mix(q: jax.Array,  # [T, H, D]  (one rank's heads throughout)
        k: jax.Array,  # [T, H, D]
        v: jax.Array,  # [T, H, D]
        f: jax.Array,  # [T, H, D] the forget gate's projection
        b: jax.Array,  # [T, H]
        gate: jax.Array,  # [T, H, D] the output gate's projection
        conv: tuple,  # [H, D, K] each: q, k, v
        decay: tuple,  # a_log [H], dt_bias [H, D]
        norm: jax.Array,  # [D]
        state: LinearState,  # recurrent [slots, H, D, D], conv [slots, H 3D, K-1]
        meta: AttentionMetadata,
        eps: float,
        lower_bound: float | None = None,  # see log_decay
        ) -> tuple[jax.Array, LinearState]:  # [T, H, D] in the model dtype, the new state
    """Convolution, Kimi delta rule and sigmoid-gated RMSNorm over a rank's heads."""
    t, h, d = q.shape
    dtype = q.dtype
    seq = token_sequences(meta.cu_q_lens, meta.num_seqs, t)
    read = read_slots(state, meta)
    weight = jnp.concatenate(conv, axis=1).reshape(h * 3 * d, -1)  # channels [q_h, k_h, v_h] head by head
    mixed, history = causal_conv(jnp.concatenate([q, k, v], axis=-1).reshape(t, h * 3 * d), weight, read.conv,
                                 meta.cu_q_lens, seq)
    mixed = jax.nn.silu(mixed.astype(jnp.float32)).astype(dtype).reshape(t, h, 3 * d)
    q, k, v = (mixed[..., i * d:(i + 1) * d].astype(jnp.float32) for i in range(3))
    q, k = _l2norm(q) * d ** -0.5, _l2norm(k)
    beta = jax.nn.sigmoid(b).astype(jnp.float32)  # in the model dtype, as transformers has it
    g = log_decay(f, *decay, lower_bound)
    o, recurrent = kimi_delta_rule_chunked(q, k, v, g, beta, meta.cu_q_lens, meta.num_seqs, read.recurrent)

    # RMSNorm per head (weight in f32), times sigmoid(gate): transformers' RMSNormGated
    o = o.astype(dtype).astype(jnp.float32)  # the rule's output in the model dtype, as transformers has it
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + eps)
    o = norm.astype(jnp.float32) * o * jax.nn.sigmoid(gate.astype(jnp.float32))
    return o.astype(dtype), write_slots(state, read, recurrent, history)
