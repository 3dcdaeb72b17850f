"""One attention block: qkv -> rope -> KV write into pages -> ragged paged attention -> out."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfill.models.config import ModelConfig
from jaxfill.models.kv_cache import AttentionMetadata, sampled_rows_metadata
from jaxfill.models.layer_settings import by_window, layer_settings
from jaxfill.models.layers import RMSNorm, param, projection
from jaxfill.models.rope import apply_rope
from jaxfill.models.quant import qeinsum
from jaxfill.models.parallel.context import sharded_attention
from jaxfill.models.parallel.ring_attention import RingSpec
from jaxfill.models.sharding import constrain, kv_heads_for
from jaxfill.pallas_kernels import ragged_paged_attention, write_kv


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c, dt = config, config.jnp_dtype
        e, hq, hk, d, wd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.weight_dtype
        # with an output gate (Qwen3.5) q_proj gives each head [q, gate]: 2D columns
        q_cols = 2 * d if c.attn_output_gate else d
        self.q, self.q_scale = projection(rngs, (e, hq, q_cols), ("embed", "q_heads", "head_dim"), dt, 1, wd)
        self.k, self.k_scale = projection(rngs, (e, hk, d), ("embed", "kv_heads", "head_dim"), dt, 1, wd)
        self.v, self.v_scale = projection(rngs, (e, hk, d), ("embed", "kv_heads", "head_dim"), dt, 1, wd)
        self.o, self.o_scale = projection(rngs, (hq, d, e), ("q_heads", "head_dim", "embed"), dt, 2, wd)
        if c.attention_bias:
            self.q_bias = param(rngs, (c.num_heads, c.head_dim), ("q_heads", "head_dim"), dt)
            self.k_bias = param(rngs, (c.num_kv_heads, c.head_dim), ("kv_heads", "head_dim"), dt)
            self.v_bias = param(rngs, (c.num_kv_heads, c.head_dim), ("kv_heads", "head_dim"), dt)
        if c.qk_norm == "head":  # over each head's D
            self.q_norm = RMSNorm(d, c.rms_norm_eps, dt, rngs, kind=c.norm_kind, axes=("head_dim",))
            self.k_norm = RMSNorm(d, c.rms_norm_eps, dt, rngs, kind=c.norm_kind, axes=("head_dim",))
        elif c.qk_norm == "projection":  # over all heads of the projection
            self.q_norm = RMSNorm(d, c.rms_norm_eps, dt, rngs, kind=c.norm_kind, shape=(hq, d),
                                  axes=("q_heads", "head_dim"))
            self.k_norm = RMSNorm(d, c.rms_norm_eps, dt, rngs, kind=c.norm_kind, shape=(hk, d),
                                  axes=("kv_heads", "head_dim"))
        if c.attention_out_bias:
            self.o_bias = param(rngs, (e,), ("embed",), dt)
        # gpt-oss: one learned logit per head in the softmax denominator
        self.sinks = param(rngs, (hq,), ("q_heads",), dt, scale=1.0) if c.attention_sinks else None
        self.config = c
        self.sm_scale = c.query_scale if c.query_scale is not None else c.head_dim ** -0.5

    def __call__(self,
                 x: jax.Array,  # [T, E]
                 positions: jax.Array,  # [T] int32
                 pages: jax.Array,  # [num_pages, page_size, 2 * Hkv, D]
                 meta: AttentionMetadata,
                 impl: str,
                 layer,  # this layer's number: a Python int, or traced in a stacked layout
                 sampled_only: bool = False,
                 ) -> tuple[jax.Array, jax.Array]:  # [T, E] ([S, E] if sampled_only), pages
        """K/V of every row go into the pages. With `sampled_only` queries (and the output)
        exist only for each sequence's sampled row, `meta.logits_indices`: in the last
        layer no other row feeds anything, so its queries would be wasted work. The
        layer's rope and window come from models/layer_settings.py by `layer`."""
        k = qeinsum("te,ehd->thd", x, self.k[...], self.k_scale)
        v = qeinsum("te,ehd->thd", x, self.v[...], self.v_scale)
        q_pos = positions
        if sampled_only:
            x, q_pos = jnp.take(x, meta.logits_indices, axis=0), jnp.take(positions, meta.logits_indices)
        q = qeinsum("te,ehd->thd", x, self.q[...], self.q_scale)
        gate = None
        if self.config.attn_output_gate:
            q, gate = q[..., :self.config.head_dim], q[..., self.config.head_dim:]  # [T, Hq, D] each
        if self.config.attention_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if self.config.qk_norm != "none":
            q, k = self.q_norm(q), self.k_norm(k)
        settings = layer_settings(self.config)
        if not (isinstance(layer, int) and not settings.has_rope[layer]):
            inv_freq, scale = settings.rope(layer)
            q, k = apply_rope(q, q_pos, inv_freq, scale), apply_rope(k, positions, inv_freq, scale)
        # A cache laid out for more KV heads than the model has (tensor parallel with
        # Hkv < tensor, see models/sharding.py) holds each head repeated r times in a row.
        r = kv_heads_for(pages.shape[2], k.shape[1])
        if r > 1:
            k, v = jnp.repeat(k, r, axis=1), jnp.repeat(v, r, axis=1)
        q = constrain(q, ("tokens", "act_heads", None))
        k = constrain(k, ("tokens", "act_kv_heads", None))
        v = constrain(v, ("tokens", "act_kv_heads", None))
        q_meta = sampled_rows_metadata(meta) if sampled_only else meta

        def attend(q, k, v, pages, meta, sinks, share, window):  # per-device view under a mesh
            pages = write_kv(pages, k, v, meta.slot_mapping)
            extra = {} if sinks is None else {"sinks": sinks}
            out = ragged_paged_attention(
                q, pages, meta.kv_lens, meta.page_indices, meta.cu_q_lens, meta.num_seqs,
                sm_scale=self.sm_scale, sliding_window=window, soft_cap=self.config.attn_soft_cap, impl=impl,
                **extra, **share)
            return out, pages

        sinks = None if self.sinks is None else self.sinks[...].astype(jnp.float32)
        ring = lambda w: (RingSpec(self.sm_scale, self.config.attn_soft_cap, w)  # noqa: E731
                          if self.config.context_attention == "pass_kv" else None)
        out, pages = by_window(settings, layer, lambda w: sharded_attention(
            lambda *a: attend(*a, window=w), q, k, v, pages, q_meta, sinks, sinks=sinks is not None,
            ring=ring(w)))
        if gate is not None:
            out = out * jax.nn.sigmoid(gate).astype(out.dtype)
        out = qeinsum("thd,hde->te", out, self.o[...], self.o_scale)  # all-reduce over tensor
        if self.config.attention_out_bias:
            out = out + self.o_bias[...]
        return constrain(out, ("tokens", "act_embed")), pages
