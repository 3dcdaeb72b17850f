"""Mamba2, the state-space mixer of Nemotron-H.

Per token: one input projection gives the gate z [H, P], the convolved channels
x [H, P], B [G, N], C [G, N] (one short causal depthwise convolution with bias over
the three, SiLU) and a raw time step per head; the SSD rule (pallas_kernels/ssd.py;
its chunk loop in XLA, or the Pallas TPU kernel of ssd_tpu.py with model.linear_impl =
pallas_tpu) over an [H, N, P] state, with the D skip; the output times silu(z), then an
RMSNorm over each of the G groups of H / G heads (not per head, not over all: Nemotron-H's
`NemotronHRMSNormGated`), in f32 with the weight applied before the one cast; the
output projection.

The shapes ride on ModelConfig's linear_* fields (models/config.py): key heads = G,
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
from jaxfill.models.layers import param
from jaxfill.models.linear_slots import read_slots, write_slots
from jaxfill.models.linear_state import LinearState, conv_dim
from jaxfill.pallas_kernels.ragged_scan import token_sequences
from jaxfill.pallas_kernels.ssd import ssd_chunked, time_steps
from jaxfill.pallas_kernels.ssd_tpu import ssd_tpu


class Mamba2(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c, dt = config, config.jnp_dtype
        e, h, p, k = c.hidden_size, c.linear_num_value_heads, c.linear_value_head_dim, c.linear_conv_kernel
        self.z = param(rngs, (e, h, p), ("embed", None, None), dt)
        self.xbc = param(rngs, (e, conv_dim(c)), ("embed", None), dt)
        self.dt = param(rngs, (e, h), ("embed", None), dt)
        self.conv = param(rngs, (conv_dim(c), k), (None, None), dt, scale=0.3)
        self.conv_bias = param(rngs, (conv_dim(c),), (None,), dt, scale=0.1) if c.linear_conv_bias else None
        self.dt_bias = param(rngs, (h,), (None,), dt, init="one_plus_normal", scale=0.1)
        self.a_log = param(rngs, (h,), (None,), dt, scale=1.0)
        self.d = param(rngs, (h,), (None,), dt, init="one_plus_normal", scale=0.1)
        self.norm = param(rngs, (h, p), (None, None), dt, init="one_plus_normal", scale=0.1)
        self.out = param(rngs, (h, p, e), (None, None, "embed"), dt)
        self.config = c

    def __call__(self,
                 x: jax.Array,  # [T, E]
                 positions: jax.Array,  # [T] int32 (unused: the state carries position)
                 state: LinearState,
                 meta: AttentionMetadata,
                 impl: str,  # the attention impl (unused: model.linear_impl picks the scan's)
                 layer,
                 sampled_only: bool = False,
                 ) -> tuple[jax.Array, LinearState]:  # [T, E] ([S, E] if sampled_only), state
        c, f32 = self.config, jnp.float32
        g, n, h, p = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_num_value_heads, c.linear_value_head_dim
        t = x.shape[0]
        seq = token_sequences(meta.cu_q_lens, meta.num_seqs, t)
        read = read_slots(state, meta)

        z = jnp.einsum("te,ehp->thp", x, self.z[...])
        bias = None if self.conv_bias is None else self.conv_bias[...]
        xbc, history = causal_conv(x @ self.xbc[...], self.conv[...], read.conv, meta.cu_q_lens, seq, bias)
        xbc = jax.nn.silu(xbc.astype(f32)).astype(x.dtype)
        xs = xbc[:, :h * p].reshape(t, h, p)
        b = xbc[:, h * p:h * p + g * n].reshape(t, g, n)
        cc = xbc[:, h * p + g * n:].reshape(t, g, n)
        dt = time_steps(x @ self.dt[...], self.dt_bias[...], c.linear_dt_limit)
        a = -jnp.exp(self.a_log[...].astype(f32))
        scan = ssd_tpu if c.linear_impl == "pallas_tpu" else ssd_chunked  # auto: XLA, never measured on TPU
        y, recurrent = scan(xs, dt, a, b, cc, self.d[...], meta.cu_q_lens, meta.num_seqs, read.recurrent)

        # gate, then RMSNorm over each group of h / g heads, in f32; the weight before the cast
        y = (y * jax.nn.silu(z.astype(f32))).reshape(t, g, h // g * p)
        y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + c.rms_norm_eps)
        y = (self.norm[...].astype(f32) * y.reshape(t, h, p)).astype(x.dtype)
        if sampled_only:
            y = jnp.take(y, meta.logits_indices, axis=0)
        out = jnp.einsum("thp,hpe->te", y, self.out[...])
        return out, write_slots(state, read, recurrent, history)
