"""Multi-head latent attention (DeepSeek V2/V3), absorbed form over a latent paged cache.

Per token the cache holds one "head": the normalised latent c (kv_lora_rank) and the
roped shared key k_pe (qk_rope_head_dim), side by side. Head h's key is
[W_uk_h c, k_pe] and its value W_uv_h c (W_uk, W_uv: kv_b_proj's two halves), so

    score_h = q_nope_h . W_uk_h c + q_pe_h . k_pe = [W_uk_h^T q_nope_h, q_pe_h] . [c, k_pe]
    out_h   = W_uv_h (sum_j p_hj c_j)

which is multi-query attention over the cache with queries [W_uk_h^T q_nope_h, q_pe_h]
(width kv_lora_rank + qk_rope_head_dim), then W_uv_h on the first kv_lora_rank output
dims. It runs through the same paged attention impls as every other model.

The pages hold K only, [num_pages, page_size, Hkv = 1, D] (pallas_kernels/kv_cache.py
"shared" pages): the value is the first kv_lora_rank dims of the same entry, so a token
costs kv_lora_rank + qk_rope_head_dim values per layer, the latent's size. DeepSeek sparse
attention (V3.2, GLM-5) appends its indexer's key to the entry and attends each query's
top-k keys only (models/mixers/mla_indexer.py); the dense forms then pad their queries
with zeros over those columns.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfill.models.config import ModelConfig
from jaxfill.models.kv_cache import AttentionMetadata, sampled_rows_metadata
from jaxfill.models.layer_settings import layer_settings
import jaxfill.models.fp8_block as fp8_block
from jaxfill.models.layers import RMSNorm, int8_form, mixer_projection, project, projection
from jaxfill.models.mixers.attention import query_temperature
from jaxfill.models.mixers.context import MixerContext
from jaxfill.models.mixers.mla_expanded import EXPAND_KEYS_PER_TOKEN, expanded_attention, prefers_expanded
from jaxfill.models.mixers.mla_indexer import Indexer, needs_selection, select, sparse_attention
from jaxfill.models.quant import dequantize, qeinsum
from jaxfill.models.rope import apply_rope
from jaxfill.models.parallel.context import sharded_attention
from jaxfill.models.sharding import constrain, kv_heads_for
from jaxfill.pallas_kernels import ragged_paged_attention, write_kv
from jaxfill.pallas_kernels.kv_quant import QuantizedPages


# The eps of q_a_layernorm and kv_a_layernorm: DeepSeek's code (and transformers') builds
# them with the RMSNorm default, not config.rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class LatentAttention(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c, dt = config, config.jnp_dtype
        e, h, lat, rope = c.hidden_size, c.num_heads, c.mla.kv_lora_rank, c.mla.qk_rope_head_dim
        nope, vd = c.mla.qk_nope_head_dim, c.mla.v_head_dim
        # int8 per output channel (models/quant.py), or fp8 block-scaled as a checkpoint stores them
        # (models/fp8_block.py)
        wd = c.weight_form
        heads = (None, "q_heads", "head_dim")
        if c.mla.q_lora_rank:
            r = c.mla.q_lora_rank
            self.q_a, self.q_a_scale = projection(rngs, (e, r), ("embed", None), dt, 1, wd, name="q_a")
            self.q_a_norm = RMSNorm(r, LATENT_NORM_EPS, dt, rngs, kind=c.norms.kind)
            self.q_b, self.q_b_scale = projection(rngs, (r, h, nope + rope), heads, dt, 1, wd, name="q_b")
        else:
            self.q, self.q_scale = projection(rngs, (e, h, nope + rope), ("embed",) + heads[1:], dt, 1, wd, name="q")
        self.kv_a, self.kv_a_scale = projection(rngs, (e, lat + rope), ("embed", None), dt, 1, wd, name="kv_a")
        self.kv_a_norm = RMSNorm(lat, LATENT_NORM_EPS, dt, rngs, kind=c.norms.kind)
        # kv_b_proj: per head, W_uk (the first nope columns) and W_uv (the last v_head_dim)
        self.w_ukv, self.w_ukv_scale = projection(rngs, (lat, h, nope + vd), heads, dt, 1, wd, name="w_ukv")
        self.o, self.o_scale = projection(rngs, (h, vd, e), ("q_heads", "head_dim", "embed"), dt, 2, wd, name="o")
        self.indexer = Indexer(c, rngs) if c.mla.index_topk else None
        # Ling 2.5's per-head output gate (mla_head_gate): sigmoid(x @ g), one scalar per head
        self.g, self.g_scale = (mixer_projection(rngs, (e, h), ("embed", "q_heads"), dt, int8_form(c), "g")
                                if c.mla.head_gate else (None, None))
        self.config = c
        self.sm_scale = c.attention.query_scale if c.attention.query_scale is not None else (nope + rope) ** -0.5

    def _rope(self, x: jax.Array,  # [T, H, R]
              positions: jax.Array,  # [T] int32
              layer) -> jax.Array:
        if self.config.attention.rope_interleave:  # (x0, x1), (x2, x3) ... -> evens, then odds (rotate-half)
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        inv_freq, scale = layer_settings(self.config).rope(layer)
        return apply_rope(x, positions, inv_freq, scale)

    def __call__(self,
                 x: jax.Array,  # [T, E]
                 pages: jax.Array,  # [num_pages, page_size, r, mla.entry_width] (r: tensor repeats)
                 ctx: MixerContext,
                 ) -> tuple[jax.Array, jax.Array]:  # [T, E] ([S, E] if ctx.sampled_only), pages
        c = self.config
        lat, nope = c.mla.kv_lora_rank, c.mla.qk_nope_head_dim
        kv = qeinsum("te,ec->tc", x, self.kv_a[...], self.kv_a_scale)  # [T, lat + rope]
        latent = self.kv_a_norm(kv[:, :lat])
        if c.mla.latent_scale != 1.0:  # LongCat-Flash scales the latent before it keys and values anything
            latent = latent * jnp.asarray(c.mla.latent_scale, latent.dtype)
        k_pe = self._rope(kv[:, None, lat:], ctx.positions, ctx.layer)  # [T, 1, rope]
        parts = [latent[:, None, :], k_pe.astype(latent.dtype)]
        if self.indexer is not None:
            parts.append(self.indexer.key(x, ctx.positions, ctx.layer)[:, None, :].astype(latent.dtype))
        k = jnp.concatenate(parts, axis=-1)  # [T, 1, entry_width]
        x, positions = ctx.sampled(x), ctx.sampled(ctx.positions)
        index = None
        if c.mla.q_lora_rank:
            q_latent = self.q_a_norm(qeinsum("te,er->tr", x, self.q_a[...], self.q_a_scale))
            q = qeinsum("tr,rhd->thd", q_latent, self.q_b[...], self.q_b_scale)
            if self.indexer is not None:
                index = (*self.indexer.queries(q_latent, x, positions, ctx.layer), positions)
        else:
            q = qeinsum("te,ehd->thd", x, self.q[...], self.q_scale)
        q_pe = self._rope(q[..., nope:], positions, ctx.layer)
        q = jnp.concatenate([q[..., :nope], q_pe.astype(q.dtype)], axis=-1)
        a, beta = c.attention, layer_settings(c).of_layer(layer_settings(c).temperature, ctx.layer)
        if a.query_temperature_beta and not (isinstance(ctx.layer, int) and beta == 0):  # Mistral 4: after rope
            scale = query_temperature(positions + a.query_temperature_offset, beta, a.query_temperature_length)
            q = q * scale.astype(q.dtype)[:, None, None]  # nope and rope dims alike
        r = kv_heads_for(2 * pages.shape[2], 1)  # a cache laid out for 'tensor' repeats the one head
        if r > 1:
            k = jnp.repeat(k, r, axis=1)
        q = constrain(q, ("tokens", "act_heads", None))
        k = constrain(k, ("tokens", "act_kv_heads", None))
        q_meta = sampled_rows_metadata(ctx.meta) if ctx.sampled_only else ctx.meta
        w_ukv = self._up_projection(x.dtype)
        w_ukv = w_ukv.transpose(1, 0, 2)  # [H, lat, nope + vd]: heads first, split like q's
        attend = functools.partial(self._write_and_attend, impl=ctx.impl)
        out, pages = sharded_attention(attend, q, k, k, pages, q_meta, w_ukv, replicated=index)  # [T, H, vd]
        if self.g is not None:  # the gate in f32, cast to the model dtype, as transformers has it
            gate = jax.nn.sigmoid(project(self, "g", "te,eh->th", x).astype(jnp.float32)).astype(x.dtype)
            out = out * constrain(gate, ("tokens", "act_heads"))[..., None]
        out = qeinsum("thv,hve->te", out, self.o[...], self.o_scale)  # all-reduce over tensor
        return constrain(out, ("tokens", "act_embed")), pages

    def _up_projection(self, dtype) -> jax.Array:  # [lat, H, nope + vd]
        """kv_b_proj in `dtype`, dequantized once per step: the absorbed form contracts W_uk
        over its output channels (q_nope . W_uk), where a per-output-channel scale cannot
        wait until after the matmul. int8: one scale per column of the [lat, H (nope + vd)]
        matrix; fp8: its blocks."""
        w, scale = self.w_ukv[...], self.w_ukv_scale
        if scale is None:
            return w
        if fp8_block.is_fp8(w.dtype):
            return fp8_block.dequantize_param(w, scale, dtype)
        return dequantize(w, scale[...], dtype)

    def _write_and_attend(self, q, k, v, pages, meta, w_ukv, share, *, impl: str, replicated=None):
        """One device's view under a mesh; v is k: K-only pages, the value is the latent.
        `replicated`: the indexer's (queries, weights, positions) of DeepSeek sparse attention."""
        pages = write_kv(pages, k, None, meta.slot_mapping)
        nope = self.config.mla.qk_nope_head_dim
        w_uk, w_uv = w_ukv[..., :nope], w_ukv[..., nope:]
        dense = lambda: self._attend(q, pages, meta, w_uk, w_uv, impl, share)  # noqa: E731
        if replicated is None:
            return dense(), pages
        sparse = lambda: self._attend_selected(q, pages, meta, w_uk, w_uv, *replicated)  # noqa: E731
        return jax.lax.cond(needs_selection(meta, self.config.mla.index_topk), sparse, dense), pages

    def _attend_selected(self, q: jax.Array,  # [T, H, nope + rope]
                         pages, meta: AttentionMetadata,
                         w_uk: jax.Array,  # [H, lat, nope]
                         w_uv: jax.Array,  # [H, lat, vd]
                         index_q: jax.Array,  # [T, index heads, index_head_dim]
                         index_weights: jax.Array,  # [T, index heads] f32
                         positions: jax.Array,  # [T] int32
                         ) -> jax.Array:  # [T, H, vd]
        """DeepSeek sparse attention: the absorbed form over each row's top-k keys."""
        m = self.config.mla
        chosen, valid = select(pages, meta, index_q, index_weights, positions,
                               m.kv_lora_rank + m.qk_rope_head_dim, m.index_topk)
        q_lat = jnp.einsum("thn,hcn->thc", q[..., :m.qk_nope_head_dim], w_uk)
        qa = jnp.concatenate([q_lat, q[..., m.qk_nope_head_dim:].astype(q_lat.dtype)], axis=-1)
        out = sparse_attention(pages, meta, qa, chosen, valid, self.sm_scale, m.kv_lora_rank)
        return jnp.einsum("thc,hcv->thv", out.astype(w_uv.dtype), w_uv)

    def _attend(self, q: jax.Array,  # [T, H, nope + rope]
                pages,  # [N, page_size, 1, entry_width] K-only latent pages (or QuantizedPages)
                meta: AttentionMetadata,
                w_uk: jax.Array,  # [H, lat, nope]
                w_uv: jax.Array,  # [H, lat, vd]
                impl: str,
                share: dict | None = None) -> jax.Array:  # [T, H, vd] (and its LSE [T, H] with a context-parallel share)
        """A context-parallel share (models/parallel/context.py) takes the absorbed form:
        the expanded one sizes its copy by whole sequences, not by a rank's stripe."""
        c = self.config
        nope, lat = c.mla.qk_nope_head_dim, c.mla.kv_lora_rank
        page_size, width = (pages.values if isinstance(pages, QuantizedPages) else pages).shape[1::2]

        def absorbed():
            q_lat = jnp.einsum("thn,hcn->thc", q[..., :nope], w_uk)  # [T, H, lat]
            qa = jnp.concatenate([q_lat, q[..., nope:].astype(q_lat.dtype)], axis=-1)
            qa = jnp.pad(qa, ((0, 0), (0, 0), (0, width - qa.shape[-1])))  # zeros on the indexer's columns
            out = ragged_paged_attention(qa, pages, meta.kv_lens, meta.page_indices, meta.cu_q_lens,
                                         meta.num_seqs, sm_scale=self.sm_scale, impl=impl, kv_shared=True,
                                         **(share or {}))
            out, lse = out if share else (out, None)
            # w_uv is linear, so ranks' projected partial outputs still merge by their LSEs
            out = jnp.einsum("thc,hcv->thv", out[..., :lat].astype(w_uv.dtype), w_uv)
            return out if lse is None else (out.astype(jnp.float32), lse)

        s, p = meta.page_indices.shape
        forced = c.mla.form == "expanded"
        cap = s * p if forced else min(s * p, -(-EXPAND_KEYS_PER_TOKEN * q.shape[0] // page_size) + s)

        def expanded():
            out = expanded_attention(q, pages, meta, w_uk, w_uv, cap=cap, sm_scale=self.sm_scale, impl=impl)
            return out.astype(w_uv.dtype)

        if c.mla.form == "absorbed" or share:
            return absorbed()
        if forced:
            return expanded()
        use = prefers_expanded(meta, page_size, cap, lat=lat, rope=c.mla.qk_rope_head_dim, nope=nope, vd=c.mla.v_head_dim)
        return jax.lax.cond(use, expanded, absorbed)
