"""One attention block: qkv -> rope -> KV write into pages -> ragged paged attention -> out."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfill.models.config import ModelConfig
from jaxfill.models.kv_cache import AttentionMetadata, sampled_rows_metadata
from jaxfill.models.layers import apply_rope, param, projection, rope_inv_freq
from jaxfill.models.quant import qeinsum
from jaxfill.models.sharding import constrain, kv_heads_for, sharded_attention
from jaxfill.pallas_kernels import ragged_paged_attention, write_kv


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c, dt = config, config.jnp_dtype
        e, hq, hk, d, wd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.weight_dtype
        self.q, self.q_scale = projection(rngs, (e, hq, d), ("embed", "q_heads", "head_dim"), dt, 1, wd)
        self.k, self.k_scale = projection(rngs, (e, hk, d), ("embed", "kv_heads", "head_dim"), dt, 1, wd)
        self.v, self.v_scale = projection(rngs, (e, hk, d), ("embed", "kv_heads", "head_dim"), dt, 1, wd)
        self.o, self.o_scale = projection(rngs, (hq, d, e), ("q_heads", "head_dim", "embed"), dt, 2, wd)
        if c.attention_bias:
            self.q_bias = param(rngs, (c.num_heads, c.head_dim), ("q_heads", "head_dim"), dt)
            self.k_bias = param(rngs, (c.num_kv_heads, c.head_dim), ("kv_heads", "head_dim"), dt)
            self.v_bias = param(rngs, (c.num_kv_heads, c.head_dim), ("kv_heads", "head_dim"), dt)
        self.has_bias = c.attention_bias
        self.inv_freq = tuple(float(f) for f in rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling_dict))
        self.sm_scale = c.head_dim ** -0.5
        self.sliding_window = c.sliding_window

    def __call__(self,
                 x: jax.Array,  # [T, E]
                 positions: jax.Array,  # [T] int32
                 pages: jax.Array,  # [num_pages, page_size, 2 * Hkv, D]
                 meta: AttentionMetadata,
                 impl: str,
                 sampled_only: bool = False,
                 ) -> tuple[jax.Array, jax.Array]:  # [T, E] ([S, E] if sampled_only), pages
        """K/V of every row go into the pages. With `sampled_only` queries (and the output)
        exist only for each sequence's sampled row, `meta.logits_indices`: in the last
        layer no other row feeds anything, so its queries would be wasted work."""
        k = qeinsum("te,ehd->thd", x, self.k[...], self.k_scale)
        v = qeinsum("te,ehd->thd", x, self.v[...], self.v_scale)
        q_pos = positions
        if sampled_only:
            x, q_pos = jnp.take(x, meta.logits_indices, axis=0), jnp.take(positions, meta.logits_indices)
        q = qeinsum("te,ehd->thd", x, self.q[...], self.q_scale)
        if self.has_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        inv_freq = jnp.asarray(self.inv_freq, jnp.float32)
        q, k = apply_rope(q, q_pos, inv_freq), apply_rope(k, positions, inv_freq)
        # A cache laid out for more KV heads than the model has (tensor parallel with
        # Hkv < tensor, see models/sharding.py) holds each head repeated r times in a row.
        r = kv_heads_for(pages.shape[2], k.shape[1])
        if r > 1:
            k, v = jnp.repeat(k, r, axis=1), jnp.repeat(v, r, axis=1)
        q = constrain(q, ("tokens", "act_heads", None))
        k = constrain(k, ("tokens", "act_kv_heads", None))
        v = constrain(v, ("tokens", "act_kv_heads", None))
        q_meta = sampled_rows_metadata(meta) if sampled_only else meta

        def attend(q, k, v, pages, meta):  # per-device view under a mesh
            pages = write_kv(pages, k, v, meta.slot_mapping)
            out = ragged_paged_attention(
                q, pages, meta.kv_lens, meta.page_indices, meta.cu_q_lens, meta.num_seqs,
                sm_scale=self.sm_scale, sliding_window=self.sliding_window, impl=impl)
            return out, pages

        out, pages = sharded_attention(attend, q, k, v, pages, q_meta)
        out = qeinsum("thd,hde->te", out, self.o[...], self.o_scale)  # all-reduce over tensor
        return constrain(out, ("tokens", "act_embed")), pages
