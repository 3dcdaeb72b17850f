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
from jaxfill.models.layers import param
from jaxfill.models.linear_slots import read_slots, write_slots
from jaxfill.models.linear_state import LinearState, conv_dim
from jaxfill.pallas_kernels.gated_delta_rule import gated_delta_rule_chunked, token_sequences

L2_EPS = 1e-6  # transformers' and flash-linear-attention's l2norm: x * rsqrt(sum(x^2) + eps)


def _l2norm(x: jax.Array) -> jax.Array:  # [..., D] f32
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


class GatedDeltaNet(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c, dt = config, config.jnp_dtype
        e, hk, hv, dv = c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads, c.linear_value_head_dim
        if c.linear_grouped_proj:  # per key head [q, k, v, z] and [b, a] (Qwen3-Next's in_proj_qkvz / _ba)
            r = hv // hk
            self.qkvz = param(rngs, (e, hk, 2 * c.linear_key_head_dim + 2 * r * dv), ("embed", None, None), dt)
            self.ba = param(rngs, (e, hk, 2 * r), ("embed", None, None), dt)
        else:
            self.qkv = param(rngs, (e, conv_dim(c)), ("embed", None), dt)
            self.z = param(rngs, (e, hv, dv), ("embed", None, None), dt)
            self.b = param(rngs, (e, hv), ("embed", None), dt)
            self.a = param(rngs, (e, hv), ("embed", None), dt)
        self.conv = param(rngs, (conv_dim(c), c.linear_conv_kernel), (None, None), dt, scale=0.3)
        self.dt_bias = param(rngs, (hv,), (None,), dt, init="one_plus_normal", scale=0.1)
        self.a_log = param(rngs, (hv,), (None,), dt, scale=1.0)
        self.norm = param(rngs, (dv,), (None,), dt, init="one_plus_normal", scale=0.1)
        self.out = param(rngs, (hv, dv, e), (None, None, "embed"), dt)
        self.config = c

    def project(self, x: jax.Array,  # [T, E]
                ) -> tuple[jax.Array, ...]:  # qkv [T, conv_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv]
        """The input projections, in Qwen3.5's channel order (q, k, v heads in turn) whatever
        the checkpoint's layout."""
        c = self.config
        if not c.linear_grouped_proj:
            return x @ self.qkv[...], jnp.einsum("te,ehd->thd", x, self.z[...]), x @ self.b[...], x @ self.a[...]
        t, dk, dv = x.shape[0], c.linear_key_head_dim, c.linear_value_head_dim
        rdv = c.linear_num_value_heads // c.linear_num_key_heads * dv
        p = jnp.einsum("te,egw->tgw", x, self.qkvz[...])  # [T, Hk, 2 Dk + 2 r Dv]
        q, k, v, z = p[..., :dk], p[..., dk:2 * dk], p[..., 2 * dk:2 * dk + rdv], p[..., 2 * dk + rdv:]
        ba = jnp.einsum("te,egw->tgw", x, self.ba[...])  # [T, Hk, 2r]
        r = ba.shape[-1] // 2
        qkv = jnp.concatenate([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], axis=-1)
        return qkv, z.reshape(t, -1, dv), ba[..., :r].reshape(t, -1), ba[..., r:].reshape(t, -1)

    def __call__(self,
                 x: jax.Array,  # [T, E]
                 positions: jax.Array,  # [T] int32 (unused: the state carries position)
                 state: LinearState,
                 meta: AttentionMetadata,
                 impl: str,  # unused (one algorithm today)
                 layer,
                 sampled_only: bool = False,
                 ) -> tuple[jax.Array, LinearState]:  # [T, E] ([S, E] if sampled_only), state
        c = self.config
        hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        t = x.shape[0]
        seq = token_sequences(meta.cu_q_lens, meta.num_seqs, t)
        read = read_slots(state, meta)

        qkv, z, b, a = self.project(x)
        mixed, history = causal_conv(qkv, self.conv[...], read.conv, meta.cu_q_lens, seq)
        mixed = jax.nn.silu(mixed.astype(jnp.float32)).astype(x.dtype)
        q = mixed[:, :hk * dk].reshape(t, hk, dk).astype(jnp.float32)
        k = mixed[:, hk * dk:2 * hk * dk].reshape(t, hk, dk).astype(jnp.float32)
        v = mixed[:, 2 * hk * dk:].reshape(t, hv, dv)
        q, k = _l2norm(q) * dk ** -0.5, _l2norm(k)
        q, k = jnp.repeat(q, hv // hk, axis=1), jnp.repeat(k, hv // hk, axis=1)
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        g = -jnp.exp(self.a_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        o, recurrent = gated_delta_rule_chunked(q, k, v.astype(jnp.float32), g, beta, meta.cu_q_lens,
                                                meta.num_seqs, read.recurrent)

        # RMSNorm per head, then times silu(z): transformers' RMSNormGated cast order
        o = o.astype(x.dtype).astype(jnp.float32)  # the rule's output in the model dtype, as transformers has it
        o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + c.rms_norm_eps)
        o = (self.norm[...] * o.astype(x.dtype)).astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
        o = o.astype(x.dtype)
        if sampled_only:
            o = jnp.take(o, meta.logits_indices, axis=0)
        out = jnp.einsum("thd,hde->te", o, self.out[...])
        return out, write_slots(state, read, recurrent, history)
