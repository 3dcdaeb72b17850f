"""DeepSeek sparse attention (DeepSeek V3.2, GLM-5): the lightning indexer and MLA over the
positions it selects.

Per token the indexer keeps one key k_t (index_head_dim wide: a projection of the layer's
input, LayerNorm, rope on its first qk_rope_head_dim dims). Its queries come from the q
latent (q_a_norm(x q_a)), index_n_heads of them, each weighted by a projection of x:

    I(t, j) = sum_h w_th / sqrt(H) * relu(q_th . k_j / sqrt(index_head_dim))

over the causal positions j <= pos(t); query t then attends only its index_topk best j.

The key lives in the latent cache entry itself, as index_head_dim more columns after
[latent | roped key] (`MLAConfig.entry_width`): it is written by the same write_kv in
the same step, and prefix caching, the host and disk tiers and disaggregation move it
with the latent with no machinery of their own. Int8 / fp8 pages quantize the whole
entry with one scale per token.

While no live sequence holds more than index_topk tokens every causal key is selected,
so the step runs dense MLA (the same program as DeepSeek V3's; a `lax.cond`), and the
indexer costs nothing but its key's write. Past that, `sparse_attention` scores every
cached key of the query's sequence, takes the top k, gathers those k latent entries and
attends them in the absorbed form. That gather is per query row ([T, k, kv_lora_rank +
rope]) and the scores are [T, index heads, context]: correct, and fine for the small
batches it runs here; a fast path would score in a fused paged kernel (fp8, as
DeepSeek's DeepGEMM) and attend the selected rows with a sparse MLA kernel (FlashMLA's)
instead of XLA gathers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfill.models.config import ModelConfig
from jaxfill.models.grouped_matmul import TILE, tiled_grouped_matmul
from jaxfill.models.kv_cache import AttentionMetadata
from jaxfill.models.layers import RMSNorm, int8_form, mixer_projection, param, project
from jaxfill.models.layer_settings import layer_settings
from jaxfill.models.rope import apply_rope
from jaxfill.pallas_kernels.kv_quant import QuantizedPages, dequantize

# transformers' indexer builds its k_norm LayerNorm with this eps, whatever rms_norm_eps says
INDEX_NORM_EPS = 1e-6


class Indexer(nnx.Module):
    """The lightning indexer's weights. Replicated over 'tensor': every rank scores every
    key itself (the scores sum over the indexer's heads, so splitting them would need an
    all-reduce of [T, context] scores per layer)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c, dt = config, config.jnp_dtype
        h, d = c.mla.index_n_heads, c.mla.index_head_dim
        wd = int8_form(c)
        self.index_q, self.index_q_scale = mixer_projection(rngs, (c.mla.q_lora_rank, h, d), (None, None, None), dt,
                                                            wd, "index_q")
        self.index_k, self.index_k_scale = mixer_projection(rngs, (c.hidden_size, d), ("embed", None), dt, wd,
                                                            "index_k")
        self.k_norm = RMSNorm(d, INDEX_NORM_EPS, dt, rngs, kind="layer")
        # f32 whatever the model's dtype, as transformers keeps it (_keep_in_fp32_modules)
        self.index_weights = param(rngs, (c.hidden_size, h), ("embed", None), jnp.float32)
        self.config = c

    def _rope(self, x: jax.Array,  # [T, H, index_head_dim]
              positions: jax.Array,  # [T] int32
              layer) -> jax.Array:
        """Rope on the first qk_rope_head_dim dims, with the layer's frequencies and YaRN
        scale (the latent key's), in halves (V3.2) or (even, odd) pairs (GLM-5)."""
        inv_freq, scale = layer_settings(self.config).rope(layer)
        return apply_rope(x, positions, inv_freq, scale, interleaved=self.config.mla.index_rope_interleave)

    def key(self, x: jax.Array,  # [T, E] the layer's normed input
            positions: jax.Array,  # [T] int32
            layer) -> jax.Array:  # [T, index_head_dim]
        k = self.k_norm(project(self, "index_k", "te,ed->td", x))
        return self._rope(k[:, None, :], positions, layer)[:, 0]

    def queries(self, q_latent: jax.Array,  # [T, q_lora_rank], q_a_norm's output
                x: jax.Array,  # [T, E]
                positions: jax.Array,  # [T] int32
                layer) -> tuple[jax.Array, jax.Array]:  # q [T, H, D], weights [T, H] f32
        q = self._rope(project(self, "index_q", "tr,rhd->thd", q_latent), positions, layer)
        h = self.config.mla.index_n_heads
        weights = (x.astype(jnp.float32) @ self.index_weights[...]) * h ** -0.5
        return q, weights


def row_sequences(meta: AttentionMetadata, rows: int) -> tuple[jax.Array, jax.Array]:
    """Each query row's sequence slot [T] and whether it is a live row [T] (padding rows
    lie past the live sequences' total: cu_q_lens repeats it)."""
    cu = meta.cu_q_lens
    r = jnp.arange(rows)
    seq = jnp.clip(jnp.searchsorted(cu[1:], r, side="right"), 0, meta.kv_lens.shape[0] - 1)
    return seq.astype(jnp.int32), r < cu[meta.num_seqs[0]]


def needs_selection(meta: AttentionMetadata, topk: int) -> jax.Array:
    """True when some live sequence holds more than `topk` tokens: below that the indexer
    selects every causal key, and dense MLA is the same attention."""
    live = jnp.arange(meta.kv_lens.shape[0]) < meta.num_seqs[0]
    return jnp.any(live & (meta.kv_lens > topk))


def _entries(pages, page: jax.Array, offset: jax.Array, lo: int, hi: int, dtype) -> jax.Array:
    """Columns [lo, hi) of the cache entries at (page, offset) (any equal shapes), dequantized."""
    if isinstance(pages, QuantizedPages):
        return dequantize(pages.values[page, offset, 0, lo:hi], pages.scales[page, offset, 0], dtype)
    return pages[page, offset, 0, lo:hi].astype(dtype)


def select(pages,  # [N, page_size, r, entry_width] (or QuantizedPages), this step's keys written
           meta: AttentionMetadata,  # the query rows' metadata
           q: jax.Array,  # [T, H, D] the indexer's roped queries
           weights: jax.Array,  # [T, H] f32
           positions: jax.Array,  # [T] int32, each query row's position
           key_from: int, topk: int) -> tuple[jax.Array, jax.Array]:  # positions [T, k], valid [T, k]
    """Each row's top-k causal positions by index score (k = min(topk, the page table's
    span)); `valid` is False where a row has fewer causal keys than k. Ties fall to the
    lower position (lax.top_k), as torch.topk does on CPU.

    The keys are gathered once per sequence ([S, span, D]) and each sequence's rows are
    scored against its own keys by a grouped matmul (rows are (token, head) pairs, grouped
    by sequence, which the ragged layout keeps contiguous). Gathering them per query row
    instead copied [T, span, D] and scored row by row: 18-40x dense MLA's time on CPU
    (benchmarks/RESULTS.md, issue 45)."""
    page_size = (pages.values if isinstance(pages, QuantizedPages) else pages).shape[1]
    seq, live = row_sequences(meta, q.shape[0])
    (t, h, d), seqs = q.shape, meta.page_indices.shape[0]
    span = meta.page_indices.shape[1] * page_size
    j = jnp.arange(span)
    keys = _entries(pages, meta.page_indices[:, j // page_size], j % page_size, key_from, None,
                    jnp.float32)  # [S, L, D]
    keys = jnp.where((j[None, :] < meta.kv_lens[:, None])[..., None], keys, 0.0)  # unwritten slots may hold NaN
    rows = (meta.cu_q_lens[1:] - meta.cu_q_lens[:-1]) * h  # [S] (token, head) rows per sequence
    # prefill-sized groups fill 128-row tiles; a decode row's group is h rows: tiles near that
    tile = TILE if t >= 4 * seqs else max(8, 1 << (h - 1).bit_length())
    scores = tiled_grouped_matmul(q.astype(jnp.float32).reshape(t * h, d), keys.transpose(0, 2, 1), rows, tile)
    scores = jax.nn.relu(scores.reshape(t, h, span) * d ** -0.5)
    index = jnp.einsum("th,thl->tl", weights, scores)
    causal = live[:, None] & (j[None, :] <= positions[:, None])  # [T, L]
    index = jnp.where(causal, index, -jnp.inf)
    _, chosen = jax.lax.top_k(index, min(topk, span))
    return chosen, jnp.take_along_axis(causal, chosen, axis=1)


# Below these sizes sparse_attention scores the sequence's whole span with two grouped
# matmuls and masks all but the chosen keys, instead of gathering [T, k, entry] per row
DENSE_SCORES_MAX = 1 << 27  # T x heads x span f32 scores (512 MiB)
DENSE_SPAN_PER_TOPK = 16  # span / top-k: past it the gather's fewer FLOPs win


def sparse_attention(pages,  # [N, page_size, r, entry_width] (or QuantizedPages)
                     meta: AttentionMetadata,
                     qa: jax.Array,  # [T, H, lat + rope] absorbed queries (W_uk^T q_nope, roped q_pe)
                     chosen: jax.Array,  # [T, k] int32 positions
                     valid: jax.Array,  # [T, k] bool
                     sm_scale: float, lat: int) -> jax.Array:  # [T, H, lat] f32: softmax-weighted latents
    """Absorbed MLA over each row's chosen positions only: scores against [latent | roped
    key], values the latent; f32 softmax, rows with nothing valid (padding) give 0. Two
    forms of the same sum, chosen by static shapes: a short span runs as matmuls over the
    sequence's entries with the unchosen keys masked (XLA's per-row gathers cost more than
    the extra FLOPs there), a long one gathers each row's k entries."""
    page_size = (pages.values if isinstance(pages, QuantizedPages) else pages).shape[1]
    t, h, width = qa.shape
    span = meta.page_indices.shape[1] * page_size
    if t * h * span <= DENSE_SCORES_MAX and span <= DENSE_SPAN_PER_TOPK * chosen.shape[1]:
        return _masked_dense_attention(pages, meta, qa, chosen, valid, sm_scale, lat)
    seq, _ = row_sequences(meta, t)
    page = jnp.take_along_axis(meta.page_indices[seq], chosen // page_size, axis=1)  # [T, k]
    entries = _entries(pages, page, chosen % page_size, 0, width, qa.dtype)  # [T, k, lat + rope]
    entries = jnp.where(valid[..., None], entries, jnp.zeros((), entries.dtype))
    scores = jnp.einsum("thd,tkd->thk", qa, entries, preferred_element_type=jnp.float32) * sm_scale
    p = _softmax(jnp.where(valid[:, None, :], scores, -jnp.inf))
    return jnp.einsum("thk,tkc->thc", p.astype(entries.dtype), entries[..., :lat], preferred_element_type=jnp.float32)


def _masked_dense_attention(pages, meta: AttentionMetadata,
                            qa: jax.Array,  # [T, H, lat + rope]
                            chosen: jax.Array,  # [T, k] int32 positions
                            valid: jax.Array,  # [T, k] bool
                            sm_scale: float, lat: int) -> jax.Array:  # [T, H, lat] f32
    """sparse_attention as two grouped matmuls over each sequence's entries, gathered once
    per sequence; the keys no row chose are masked out of its softmax."""
    page_size = (pages.values if isinstance(pages, QuantizedPages) else pages).shape[1]
    (t, h, width), seqs = qa.shape, meta.page_indices.shape[0]
    span = meta.page_indices.shape[1] * page_size
    j = jnp.arange(span)
    entries = _entries(pages, meta.page_indices[:, j // page_size], j % page_size, 0, width,
                       jnp.float32)  # [S, L, lat + rope]
    entries = jnp.where((j[None, :] < meta.kv_lens[:, None])[..., None], entries, 0.0)  # unwritten: NaN
    rows = (meta.cu_q_lens[1:] - meta.cu_q_lens[:-1]) * h  # [S] (token, head) rows per sequence
    tile = TILE if t >= 4 * seqs else max(8, 1 << (h - 1).bit_length())
    scores = tiled_grouped_matmul(qa.astype(jnp.float32).reshape(t * h, width), entries.transpose(0, 2, 1), rows,
                                  tile).reshape(t, h, span) * sm_scale
    picked = jnp.zeros((t, span), bool).at[jnp.arange(t)[:, None], chosen].set(valid)  # [T, L]
    p = _softmax(jnp.where(picked[:, None, :], scores, -jnp.inf))
    out = tiled_grouped_matmul(p.reshape(t * h, span), entries[..., :lat], rows, tile)  # [T * H, lat]
    return out.reshape(t, h, lat)


def _softmax(scores: jax.Array) -> jax.Array:  # [T, H, n] f32 with -inf where masked
    """Softmax over the last axis; a row with nothing unmasked (padding) gives 0s."""
    top = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0))
    total = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(total > 0, total, 1.0)
