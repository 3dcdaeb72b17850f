"""Blocked, flash-style ragged paged attention in pure JAX: the CPU default, GPU fallback.

Static shapes, ragged contents. The flat token array is cut into query blocks of
`block_q` rows; the unit of work is an *item* = (query block, sequence), listed in jnp
(work_items.py). Two paths serve a batch:

* the item path (xla_items.py): per item a loop over that sequence's KV blocks with
  dynamic bounds, so nothing above the causal diagonal (or before the sliding window) is
  ever computed, not just masked; the causal tail runs per row chunk (f32 with block_q ==
  block_kv: most of the tile above the diagonal is skipped too);
* the sequence-batched path (xla_short.py): sequences with <= `short_q` new tokens
  (decodes) share one loop over KV blocks ([S, Hkv, G*short_q, D] x [S, Hkv, block, D]
  per step) rather than one item, and one short loop, per sequence.

A pure decode batch runs only the batched path (`lax.switch`); a mixed batch (the
engine's chunked prefill next to decodes) runs both, the items skipping the decode
sequences, so a decode row never costs a whole block_q-row query block; a prefill runs
the items alone. Softmax runs in base 2 (log2(e) is folded into q) with a polynomial
exp2 that XLA CPU vectorizes well (online_softmax.py). K/V of masked blocks are zeroed
with `where` beyond kv_len, so NaN in unused page slots never reaches an output; rows of
an item that belong to another sequence, and padding rows, are dropped with `where`.
Quantized pages (int8 / fp8 with `kv_scales`) are dequantized per KV block as it is
loaded, to the compute dtype; the cache is never dequantized as a whole. Attention sinks
(gpt-oss, one logit per q head) only change the final normalisation: acc / (l + 2**(sink
- m)), in the scores' log2 units (online_softmax.normalize).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxfill.pallas_kernels.ragged_paged_attention import xla_items, xla_short
from jaxfill.pallas_kernels.ragged_paged_attention.block_sizes import (
    kv_block, xla_block_sizes, xla_diagonal_splits, xla_parallel_loops)
# exp2 is looked up here at trace time (benchmarks/attention_variants_cpu.py swaps it)
from jaxfill.pallas_kernels.ragged_paged_attention.online_softmax import LOG2E, exp2
from jaxfill.pallas_kernels.ragged_paged_attention.stripes import stripes
from jaxfill.pallas_kernels.ragged_paged_attention.work_items import sanitize_cu_q_lens, work_items


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "attention_chunk", "soft_cap",
                                             "block_q", "block_kv", "fast_exp", "sum_pad",
                                             "par", "short_q", "diag_splits", "kv_shared",
                                             "kv_stride", "return_lse"))
def ragged_paged_attention_xla(
    q: jax.Array,  # [T, Hq, D]
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * Hkv, D]
    kv_lens: jax.Array,  # [S] int32
    page_indices: jax.Array,  # [S, P] int32
    cu_q_lens: jax.Array,  # [S+1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    attention_chunk: int | None = None,  # keys of the row's own chunk of C positions only (window.py)
    soft_cap: float | None = None,
    block_q: int | None = None,
    block_kv: int | None = None,
    fast_exp: bool = True,
    sum_pad: int = 0,
    par: int | None = None,
    short_q: int = 1,  # sequences with <= short_q new tokens take the sequence-batched path
    diag_splits: int | None = None,  # row chunks of the causal diagonal; None: block_sizes' rule
    kv_scales: jax.Array | None = None,  # [num_pages, page_size, 2 * Hkv] f32 (int8/fp8 pages)
    sinks: jax.Array | None = None,  # [Hq] f32 attention sinks, natural-log units
    kv_shared: bool = False,  # pages [.., Hkv, D]: K only, V is K
    kv_stride: int = 1,  # context parallelism: this rank holds logical pages kv_offset + i * kv_stride
    kv_offset: jax.Array | None = None,  # int32 scalar, the rank (stripes.py)
    return_lse: bool = False,  # also each row's log-sum-exp [T, Hq] f32 (-inf: no key), out in f32
    key_limits: jax.Array | None = None,  # [T] int32: a row sees keys up to max(its position, this)
):  # [T, Hq, D] (and [T, Hq] with return_lse)
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, combined, _ = kv_pages.shape
    keys = stripes(kv_stride, kv_offset, page_size)
    num_kv_heads = combined if kv_shared else combined // 2
    group = num_q_heads // num_kv_heads
    num_slots, max_pages = page_indices.shape
    sizes = xla_block_sizes(num_tokens, num_slots, group, head_dim, q.dtype.itemsize, page_size)
    bq = block_q or sizes.block_q
    bk = block_kv or sizes.block_kv
    if bk % page_size:
        raise ValueError(f"block_kv {bk} must be a multiple of page_size {page_size}")
    ppb = bk // page_size
    if diag_splits is None:
        diag_splits = xla_diagonal_splits(bq, bk, page_size, q.dtype.itemsize)
    if bq % diag_splits or bk % (diag_splits * page_size):
        raise ValueError(f"diag_splits {diag_splits} must divide block_q {bq} and block_kv {bk} "
                         f"into whole pages of {page_size}")
    num_blocks = -(-num_tokens // bq)
    num_kv_blocks = -(-max_pages // ppb)
    cdt = q.dtype  # matmul operand dtype; accumulation is always f32

    cu = sanitize_cu_q_lens(cu_q_lens.astype(jnp.int32), num_seqs)
    kv_lens = kv_lens.astype(jnp.int32)
    pidx = jnp.clip(page_indices.astype(jnp.int32), 0, num_pages - 1)
    # One block past the last: a diagonal window may overrun the last block (zeroed keys).
    pidx = jnp.pad(pidx, ((0, 0), (0, (num_kv_blocks + 1) * ppb - max_pages)))
    item_block, item_seq, num_items = work_items(cu, num_seqs, num_blocks, bq)

    # q scaled so scores come out in log2 units (soft cap: scaled after the tanh).
    q_scale = sm_scale if soft_cap is not None else sm_scale * LOG2E
    exp2_fn = exp2 if fast_exp else jnp.exp2
    # Sinks in the scores' units (log2, with or without a soft cap), per KV head group.
    sinks2 = None if sinks is None else (
        sinks.astype(jnp.float32) * LOG2E).reshape(num_kv_heads, group)  # [Hkv, G]
    if par is None:
        par = xla_parallel_loops(jax.default_backend(), num_kv_heads, group)

    live = jnp.arange(num_slots, dtype=jnp.int32) < num_seqs[0]
    q_lens = jnp.where(live, cu[1:] - cu[:-1], 0)  # [S]

    def by_items(q, seq_skip=jnp.zeros((num_slots,), jnp.bool_)):
        return xla_items.by_items(q, kv_pages, kv_scales, sinks2, pidx, cu, kv_lens, item_block, item_seq,
                                  num_items, seq_skip, q_scale=q_scale, bq=bq, bk=bk, ppb=ppb, par=par,
                                  sliding_window=sliding_window, attention_chunk=attention_chunk, soft_cap=soft_cap,
                                  exp2_fn=exp2_fn,
                                  sum_pad=sum_pad, diag_splits=diag_splits, kv_shared=kv_shared,
                                  stripes=keys, want_lse=return_lse, key_limits=key_limits)

    def finish(res):  # the output in q's dtype; with its LSE, both f32 (they are merged next)
        return res if return_lse else res.astype(q.dtype)

    q_max = min(short_q, num_tokens)
    if key_limits is not None:  # rows past their diagonal (Gemma 3's image steps): the items serve every row
        return finish(by_items(q))
    if q_max <= 0 or num_tokens <= q_max:
        return finish(by_items(q))
    bk_short = kv_block(page_size, 128)
    ppb_short = bk_short // page_size
    pidx_short = jnp.pad(pidx, ((0, 0), (0, -pidx.shape[1] % ppb_short)))

    is_short = q_lens <= q_max  # [S]

    def short(q, seq_mask=jnp.ones((num_slots,), jnp.bool_)):
        q_scaled = (q.astype(jnp.float32) * q_scale).astype(cdt)
        return xla_short.attend_short(q_scaled, kv_pages, kv_scales, sinks2, pidx_short, cu, kv_lens, num_seqs,
                                      seq_mask, q_max=q_max, bk=bk_short, ppb=ppb_short,
                                      sliding_window=sliding_window, attention_chunk=attention_chunk, soft_cap=soft_cap,
                                  exp2_fn=exp2_fn,
                                      kv_shared=kv_shared, stripes=keys, want_lse=return_lse)

    def mixed(q):
        """Prefill chunks by items, decodes batched: a decode row alone in its item would
        cost a whole block_q-row query block."""
        row_seq = jnp.searchsorted(cu[1:], jnp.arange(num_tokens, dtype=jnp.int32), side="right")
        short_row = is_short[jnp.minimum(row_seq, num_slots - 1)]  # [T]
        return jax.tree.map(lambda a, b: jnp.where(short_row.reshape((-1,) + (1,) * (a.ndim - 1)), a, b),
                            short(q, is_short), by_items(q, is_short))

    # All short: the batched path alone; none short (a prefill): the items alone, so a
    # prefill pays for neither the batched path's [T, Hq, D] output nor the merge.
    branch = jnp.where(jnp.all(is_short), 0, jnp.where(jnp.any(is_short), 1, 2))
    return finish(lax.switch(branch, [short, mixed, by_items], q))
