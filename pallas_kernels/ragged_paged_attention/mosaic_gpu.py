"""Ragged paged attention as a Mosaic GPU (Hopper, sm_90a) Pallas kernel. NEVER RUN ON A GPU.

Status: lowered for CUDA (to NVVM) from a CPU host at every preset shape
(tests/test_kernel_lowering.py), and run in Mosaic GPU's CPU interpreter against the
float64 oracle with plain dots in place of wgmma (tests/test_attention_mosaic_gpu.py).
Never compiled by ptxas, never run, never compared with the oracle on a GPU; `auto`
never picks it. Until the oracle tests pass on an H100/H200, treat it as unverified.
The body is in mosaic_gpu_kernel.py; this file prepares its operands.

Why a Mosaic twin of gpu.py: JAX 0.11 deprecated Pallas' Triton lowering; Mosaic GPU is
the backend JAX keeps, and it exposes Hopper's TMA copies and warpgroup matmuls (wgmma).

Work split (same items as the other impls): grid (Hkv * n, M) with M = num_blocks + S
static work items (query block, sequence), see `work_items.work_items`. One CTA, one warpgroup:
- its q tile as a [64, D] operand: gt query heads of one KV head times block_q = 64 / gt
  tokens, g-major rows, TMA-copied once. Decode-sized buckets stack all Gp heads (G padded
  to a power of two; n = 1), prefill-sized ones take up to 64 tokens of fewer heads
  (n = Gp / gt tiles per KV head), so K/V are read once per 64 query tokens;
- a loop over KV blocks [kv_lo, kv_hi) of block_kv = 64 keys: each block is
  block_kv / page_size TMA copies, one per page through the page table, into a
  two-slot ring, block j + 1 in flight while block j is computed;
- S = Q K^T (wgmma, f32), masks (length, causal, window), soft cap, online softmax in
  log2 units (q pre-scaled by sm_scale * log2 e), P cast to bf16, O += P V (wgmma, f32);
- the item's rows that belong to its sequence go to out_items[h, item] (others zero);
  XLA sums the items of one query block (their rows are disjoint), so a query block
  split between two sequences needs no masked TMA store.
Unused pages may hold NaN: scores past kv_len are masked with `where`, and V rows past
kv_len in a block are zeroed in shared memory before the PV matmul (0 * NaN = NaN).

Quantized pages (int8 / fp8 with per token-head f32 scales): the ring holds the stored
bytes; each block is dequantized in registers (stored * scale in f32, rounded to bf16)
into one bf16 SMEM operand per K and V. The scales are gathered per sequence in XLA
first (page-table order, per combined head), so a block's scales are one TMA copy.

Attention sinks (gpt-oss): one more f32 operand per KV head, each stacked row's sink
logit in log2 units, TMA-copied beside q; exp2(sink - m) joins the denominator at the end.

Refused by name (ValueError; use pallas_gpu or xla): q not bf16/f16, head_dim not a
multiple of 32 or above 256 (wgmma K tiles; the f32 accumulator lives in registers),
a query group above 64, page_size not a multiple of 8 dividing the KV block,
shared K/V pages (latent attention).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxfill.pallas_kernels.ragged_paged_attention.mosaic_gpu_kernel import (
    _BLK, BLOCK_KV, LOG2E, ROWS, kernel)
from jaxfill.pallas_kernels.ragged_paged_attention.work_items import item_bounds, sanitize_cu_q_lens, work_items


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _refuse(q_dtype, head_dim: int, group: int, page_size: int, kv_dtype, kv_shared: bool):
    """The shapes and features this kernel does not handle, each by name."""
    why = None
    if jnp.dtype(q_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        why = f"q dtype {jnp.dtype(q_dtype).name} (wgmma operands here are bf16/f16)"
    elif head_dim % 32 or head_dim > 256:
        why = f"head_dim {head_dim} (needs a multiple of 32, at most 256)"
    elif _next_pow2(group) > ROWS:
        why = f"query group {group} (at most {ROWS} query heads per KV head)"
    elif page_size % 8 or BLOCK_KV % page_size:
        why = f"page_size {page_size} (needs a multiple of 8 dividing {BLOCK_KV})"
    elif kv_dtype is not None and jnp.dtype(kv_dtype).itemsize != 1:
        why = f"quantized KV pages of dtype {jnp.dtype(kv_dtype).name} (int8/fp8 only)"
    elif kv_shared:
        why = "shared K/V pages (latent attention)"
    if why:
        raise ValueError(f"mosaic_gpu ragged paged attention does not support {why}; "
                         f"use attention_impl='pallas_gpu' or 'xla'")


def _item_meta(cu, kv_lens, num_seqs, num_blocks: int, block_q: int, sliding_window,
               attention_chunk):
    """[M, 9] int32: each item's block, sequence, rows and KV block range, computed in XLA
    so the kernel reads plain scalars. Items past num_items get no rows and no KV blocks."""
    blk, seq, num_items = work_items(cu, num_seqs, num_blocks, block_q)
    ib = jax.vmap(lambda b, s: item_bounds(b, s, cu, kv_lens, block_q, BLOCK_KV, sliding_window,
                                           attention_chunk=attention_chunk))(blk, seq)
    live = jnp.arange(blk.shape[0], dtype=jnp.int32) < num_items
    z = jnp.zeros_like(blk)
    cols = [blk, seq, ib["r0"], jnp.where(live, ib["lo"], z), jnp.where(live, ib["hi"], z),
            ib["ctx"] - ib["q_start"], ib["kv_len"], jnp.where(live, ib["kv_lo"], z),
            jnp.where(live, ib["kv_hi"], z)]
    return jnp.stack([c.astype(jnp.int32) for c in cols], axis=1)


def interpret_params():
    """Mosaic GPU's CPU interpreter (simulated SMEM, TMA, barriers; a barrier waited out of
    phase raises) with its happen-before race detector on: how CI runs this kernel
    against the oracle without a GPU. jax 0.11 exports it as plgpu.InterpretGPUParams;
    0.10 only under jax._src."""
    cls = getattr(plgpu, "InterpretGPUParams", None)
    if cls is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as cls
    return cls(detect_races=True)


def races_found() -> bool:
    """Whether any interpreted run in this process had a data race (SMEM, GMEM)."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races
    return bool(get_races().races_found)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "attention_chunk", "soft_cap",
                                             "kv_shared", "interpret"))
def ragged_paged_attention_mosaic_gpu(
    q: jax.Array,  # [T, Hq, D] bf16/f16
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
    kv_scales: jax.Array | None = None,  # [num_pages, page_size, 2 * Hkv] f32 (int8/fp8 pages)
    sinks: jax.Array | None = None,  # [Hq] f32 attention sinks, natural-log units
    kv_shared: bool = False,  # refused
    interpret: bool = False,  # True: run in Mosaic GPU's CPU interpreter (tests)
) -> jax.Array:  # [T, Hq, D]
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, combined, _ = kv_pages.shape
    num_kv_heads = combined if kv_shared else combined // 2
    group = num_q_heads // num_kv_heads
    quantized = kv_scales is not None
    _refuse(q.dtype, head_dim, group, page_size, kv_pages.dtype if quantized else None, kv_shared)
    if not quantized and kv_pages.dtype != q.dtype:
        raise ValueError(f"mosaic_gpu needs kv_pages in q's dtype {q.dtype}, got {kv_pages.dtype}")
    gp = _next_pow2(group)
    # A tile is 64 rows = gt query heads x bq tokens. Decode-sized buckets stack all Gp
    # heads (bq = 64/Gp: one token of many sequences); prefill-sized ones take bq = 64
    # tokens of fewer heads, so each KV block is read per 64 tokens, not per 64/Gp.
    avg = -(-num_tokens // max(1, page_indices.shape[0]))
    bq = min(ROWS, max(ROWS // gp, _next_pow2(avg)))
    gt = ROWS // bq
    nt = gp // gt  # tiles per KV head
    num_blocks = -(-num_tokens // bq)
    t_pad = num_blocks * bq
    num_slots, max_pages = page_indices.shape
    ppb = BLOCK_KV // page_size
    pages_per_seq = -(-max_pages // ppb) * ppb

    cu = sanitize_cu_q_lens(cu_q_lens.astype(jnp.int32), num_seqs)
    kv_lens = kv_lens.astype(jnp.int32)
    meta = _item_meta(cu, kv_lens, num_seqs, num_blocks, bq, sliding_window, attention_chunk)
    num_items = meta.shape[0]
    pidx = jnp.clip(page_indices.astype(jnp.int32), 0, num_pages - 1)
    pidx = jnp.pad(pidx, ((0, 0), (0, pages_per_seq - max_pages))).reshape(-1)

    qs = (q.astype(jnp.float32) * (sm_scale * (1.0 if soft_cap is not None else LOG2E))).astype(q.dtype)
    qs = jnp.pad(qs, ((0, t_pad - num_tokens), (0, 0), (0, 0)))
    qs = qs.reshape(num_blocks, bq, num_kv_heads, group, head_dim)
    qs = jnp.pad(qs, ((0, 0), (0, 0), (0, 0), (0, gp - group), (0, 0)))
    qs = qs.reshape(num_blocks, bq, num_kv_heads, nt, gt, head_dim).transpose(2, 3, 0, 4, 1, 5)
    qs = qs.reshape(num_kv_heads * nt, num_blocks, ROWS, head_dim)  # rows: gt heads x bq tokens

    def smem(shape, dtype):
        """SMEM tile of rows of head_dim elements, swizzled in the widest of 128/64/32 bytes
        dividing a row (wgmma operands; bf16: 128 for head_dim 64/128/256, 64 for 96).
        The interpreter cannot model layout transforms: none there."""
        row = head_dim * jnp.dtype(dtype).itemsize
        swizzle = next(b for b in (128, 64, 32) if row % b == 0)
        tiles = (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
                 plgpu.SwizzleTransform(swizzle))
        return plgpu.SMEM(shape, dtype, transforms=() if interpret else tiles)

    operands = [meta, pidx, qs, kv_pages]
    scratch = [smem((ROWS, head_dim), q.dtype)] + [smem((2, BLOCK_KV, head_dim), kv_pages.dtype)] * 2
    if sinks is not None:
        # Per stacked row (g-major, as q's rows), in the scores' log2 units; padded heads
        # (group..Gp) get 0, their rows are never kept.
        sink_rows = (sinks.astype(jnp.float32) * LOG2E).reshape(num_kv_heads, group)
        sink_rows = jnp.pad(sink_rows, ((0, 0), (0, gp - group)))
        operands.append(jnp.repeat(sink_rows.reshape(num_kv_heads * nt, gt), bq, axis=1))  # [Hkv*nt, ROWS]
        scratch.append(plgpu.SMEM((ROWS,), jnp.float32))
    if quantized:
        # Each sequence's scales in page-table order, per combined head: a KV block's
        # scales are then BLOCK_KV contiguous f32 (one TMA copy). Costs a gather of the
        # live context's scales (1/D of its K/V bytes x 4) per call.
        scales = kv_scales.astype(jnp.float32)[pidx]  # [S * P', page_size, 2 * Hkv]
        operands.append(scales.transpose(2, 0, 1).reshape(combined, -1))
        scratch += [plgpu.SMEM((2, BLOCK_KV), jnp.float32)] * 2
        scratch += [smem((BLOCK_KV, head_dim), q.dtype)] * 2
    body = functools.partial(kernel, block_q=bq, tiles_per_kv_head=nt, page_size=page_size, pages_per_seq=pages_per_seq,
                               sliding_window=sliding_window, attention_chunk=attention_chunk, soft_cap=soft_cap,
                               sinks=sinks is not None, quantized=quantized, interpret=interpret)
    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((num_kv_heads * nt, num_items, ROWS, head_dim), q.dtype),
        scratch_types=[
            *scratch,
            plgpu.Barrier(num_arrivals=2 if sinks is not None else 1, num_barriers=1),
            # One arrival per TMA copy: a page each, and the block's scales if quantized.
            plgpu.Barrier(num_arrivals=ppb + quantized, num_barriers=2),
            plgpu.Barrier(num_arrivals=ppb + quantized, num_barriers=2),
        ],
        grid=(num_kv_heads * nt, num_items),
        grid_names=("t", "i"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params() if interpret else None,
    )(*operands)
    # Items of one query block own disjoint rows (the rest are zero): sum them per block.
    out = jax.ops.segment_sum(out.transpose(1, 0, 2, 3), meta[:, _BLK], num_segments=num_blocks)
    out = out.reshape(num_blocks, num_kv_heads, gp, bq, head_dim)[:, :, :group]  # (nt, gt) = gp
    out = out.transpose(0, 3, 1, 2, 4).reshape(t_pad, num_q_heads, head_dim)[:num_tokens]
    live = jnp.arange(num_tokens, dtype=jnp.int32) < cu[num_seqs[0]]
    return jnp.where(live[:, None, None], out, jnp.zeros((), out.dtype))
