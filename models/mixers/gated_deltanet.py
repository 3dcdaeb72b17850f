"""Gated DeltaNet, the linear-attention layer of Qwen3.5 (and Qwen3-Next).

Per token: q, k, v from one projection through a short causal depthwise convolution
(kernel `linear_conv_kernel`, SiLU), q and k l2-normalised (q also / sqrt(Dk)), each
key head shared by Hv / Hk value heads; a decay g = -exp(A_log) softplus(a + dt_bias)
and a write strength beta = sigmoid(b) per value head; the gated delta rule
(pallas_kernels/gated_delta_rule.py) over a [Hv, Dk, Dv] state; an RMSNorm per head
gated by silu(z); the output projection.

What a sequence carries between steps (`LinearState`, this layer's cache entry): the
recurrent state and the convolution's last `kernel - 1` inputs, in a slot per sequence
(models/linear_slots.py: a fresh sequence starts from zeros whatever its slot holds).
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
from jaxfill.pallas_kernels.gated_delta_rule import gated_delta_rule_chunked, token_sequences
from jaxfill.pallas_kernels.gated_delta_rule_tpu import gated_delta_rule_tpu

L2_EPS = 1e-6  # transformers' and flash-linear-attention's l2norm: x * rsqrt(sum(x^2) + eps)


def _l2norm(x: jax.Array) -> jax.Array:  # [..., D] f32
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


class GatedDeltaNet(nnx.Module):
    """Params split by head so 'tensor' ranks each hold whole key-head groups: a group is
    key head g, its q and k, and the value heads g r .. g r + r - 1 (r = Hv / Hk) with their
    v, z, b, a, decay and output rows. The convolution's channels run group by group, [q_g,
    k_g, v_g], and so does its state (models/linear_state.py), so a rank's share is one
    contiguous block."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c, dt = config, config.jnp_dtype
        e, hk, hv, dk, dv = (c.hidden_size, c.linear.num_key_heads, c.linear.num_value_heads, c.linear.key_head_dim,
                             c.linear.value_head_dim)
        r, wd = hv // hk, int8_form(c)
        if c.linear.grouped_proj:  # per key head [q, k, v, z] and [b, a] (Qwen3-Next's in_proj_qkvz / _ba)
            shapes = {"qkvz": ((e, hk, 2 * dk + 2 * r * dv), ("embed", "kv_heads", None)),
                      "ba": ((e, hk, 2 * r), ("embed", "kv_heads", None))}
        else:
            shapes = {"q": ((e, hk, dk), ("embed", "kv_heads", None)), "k": ((e, hk, dk), ("embed", "kv_heads", None)),
                      "v": ((e, hk, r * dv), ("embed", "kv_heads", None)), "z": ((e, hv, dv), ("embed", "q_heads", None)),
                      "b": ((e, hv), ("embed", "q_heads")), "a": ((e, hv), ("embed", "q_heads"))}
        for name, (shape, axes) in shapes.items():  # int8 with their scales, or float (models/quant.py)
            w, scale = mixer_projection(rngs, shape, axes, dt, wd, name)
            setattr(self, name, w)
            setattr(self, name + "_scale", scale)
        # the depthwise convolutions stay in the model dtype: K values per channel
        k = c.linear.conv_kernel
        self.conv_q = param(rngs, (hk, dk, k), ("kv_heads", None, None), dt, scale=0.3)
        self.conv_k = param(rngs, (hk, dk, k), ("kv_heads", None, None), dt, scale=0.3)
        self.conv_v = param(rngs, (hk, r * dv, k), ("kv_heads", None, None), dt, scale=0.3)
        self.dt_bias = param(rngs, (hv,), ("q_heads",), dt, init="one_plus_normal", scale=0.1)
        self.a_log = param(rngs, (hv,), ("q_heads",), dt, scale=1.0)
        self.norm = param(rngs, (dv,), (None,), dt, init="one_plus_normal", scale=0.1)
        self.out, self.out_scale = mixer_projection(rngs, (hv, dv, e), ("q_heads", None, "embed"), dt, wd, "out")
        self.config = c

    def project(self, x: jax.Array,  # [T, E]
                ) -> tuple[jax.Array, ...]:  # q, k [T, Hk, Dk], v [T, Hk, r Dv], z [T, Hv, Dv], b, a [T, Hv]
        """The input projections, whatever the checkpoint's layout."""
        c = self.config
        if not c.linear.grouped_proj:
            return tuple(project(self, name, "te,e...->t...", x) for name in ("q", "k", "v", "z", "b", "a"))
        t, dk, dv = x.shape[0], c.linear.key_head_dim, c.linear.value_head_dim
        p = project(self, "qkvz", "te,egw->tgw", x)  # [T, Hk, 2 Dk + 2 r Dv]
        rdv = (p.shape[-1] - 2 * dk) // 2
        q, k, v, z = p[..., :dk], p[..., dk:2 * dk], p[..., 2 * dk:2 * dk + rdv], p[..., 2 * dk + rdv:]
        ba = project(self, "ba", "te,egw->tgw", x)  # [T, Hk, 2r]
        r = ba.shape[-1] // 2
        return q, k, v, z.reshape(t, -1, dv), ba[..., :r].reshape(t, -1), ba[..., r:].reshape(t, -1)

    def __call__(self,
                 x: jax.Array,  # [T, E]
                 state: LinearState,
                 ctx: MixerContext,  # model.linear_impl, not ctx.impl, picks the rule's kernel
                 ) -> tuple[jax.Array, LinearState]:  # [T, E] ([S, E] if ctx.sampled_only), state
        c = self.config
        q, k, v, z, b, a = self.project(x)
        conv = (self.conv_q[...], self.conv_k[...], self.conv_v[...])
        decay = (self.a_log[...], self.dt_bias[...])
        o, state = split_over_heads(
            lambda *args: mix(*args, eps=c.norms.eps, kernel=c.linear.impl == "pallas_tpu"),
            (q, k, v, b, a, z, conv, decay, self.norm[...], state, ctx.meta),
            (1, 1, 1, 1, 1, 1, 0, 0, None, LinearState(1, 1), None), (1, LinearState(1, 1)))
        out = project(self, "out", "thd,hde->te", ctx.sampled(o))
        return constrain(out, ("tokens", "act_embed")), state  # an all-reduce over 'tensor'


def mix(q: jax.Array,  # [T, Hk, Dk]  (one rank's heads throughout)
        k: jax.Array,  # [T, Hk, Dk]
        v: jax.Array,  # [T, Hk, r Dv]
        b: jax.Array,  # [T, Hv]
        a: jax.Array,  # [T, Hv]
        z: jax.Array,  # [T, Hv, Dv]
        conv: tuple,  # [Hk, Dk, K], [Hk, Dk, K], [Hk, r Dv, K]
        decay: tuple,  # a_log [Hv], dt_bias [Hv]
        norm: jax.Array,  # [Dv]
        state: LinearState,  # recurrent [slots, Hv, Dk, Dv], conv [slots, Hk (2 Dk + r Dv), K-1]
        meta: AttentionMetadata,
        eps: float,
        kernel: bool = False,  # the chunk loop as the Pallas TPU kernel
        ) -> tuple[jax.Array, LinearState]:  # [T, Hv, Dv] in the model dtype, the new state
    """Convolution, gated delta rule and gated RMSNorm over a rank's key-head groups."""
    t, hk, dk = q.shape
    hv, dv = z.shape[1:]
    dtype = q.dtype
    seq = token_sequences(meta.cu_q_lens, meta.num_seqs, t)
    read = read_slots(state, meta)

    width = 2 * dk + v.shape[-1]  # one group's channels
    weight = jnp.concatenate(conv, axis=1).reshape(hk * width, -1)
    mixed, history = causal_conv(jnp.concatenate([q, k, v], axis=-1).reshape(t, hk * width), weight, read.conv,
                                 meta.cu_q_lens, seq)
    mixed = jax.nn.silu(mixed.astype(jnp.float32)).astype(dtype).reshape(t, hk, width)
    q, k = mixed[..., :dk].astype(jnp.float32), mixed[..., dk:2 * dk].astype(jnp.float32)
    v = mixed[..., 2 * dk:].reshape(t, hv, dv)
    q, k = _l2norm(q) * dk ** -0.5, _l2norm(k)
    q, k = jnp.repeat(q, hv // hk, axis=1), jnp.repeat(k, hv // hk, axis=1)
    a_log, dt_bias = decay
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    rule = gated_delta_rule_tpu if kernel else gated_delta_rule_chunked
    o, recurrent = rule(q, k, v.astype(jnp.float32), g, beta, meta.cu_q_lens, meta.num_seqs, read.recurrent)

    # RMSNorm per head, then times silu(z): transformers' RMSNormGated cast order
    o = o.astype(dtype).astype(jnp.float32)  # the rule's output in the model dtype, as transformers has it
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + eps)
    o = (norm * o.astype(dtype)).astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))

    return o.astype(dtype), write_slots(state, read, recurrent, history)
