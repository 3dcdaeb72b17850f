"""Ragged paged attention as a Mosaic GPU (Hopper, sm_90a) Pallas kernel. NEVER RUN ON A GPU.

Status: lowered for CUDA from a CPU host in tests (tests/test_mosaic_gpu_lowering.py);
never compiled by ptxas, never run, never compared with the oracle on a GPU. `auto`
never picks it. Until benchmarks/gpu_kernels.sh runs the oracle tests on an H100/H200
and they pass, treat every result from it as unverified.

Why a Mosaic twin of gpu.py: JAX 0.11 deprecated Pallas' Triton lowering; Mosaic GPU is
the backend JAX keeps, and it exposes Hopper's TMA copies and warpgroup matmuls (wgmma).

Work split (same items as the other impls): grid (Hkv, M) with M = num_blocks + S static
work items (query block, sequence), see `xla.work_items`. One CTA, one warpgroup:
- its query block as a [64, D] operand: Gp (G padded to a power of two) query heads
  of one KV head times block_q = 64 / Gp tokens, g-major rows, TMA-copied once;
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
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxfill.pallas_kernels.ragged_paged_attention.xla import (MASK_VALUE, item_bounds,
                                                               sanitize_cu_q_lens, work_items)

LOG2E = math.log2(math.e)
ROWS = 64  # one warpgroup's wgmma M
BLOCK_KV = 64
# Per-item scalars the XLA side computes (columns of `meta`).
_BLK, _SEQ, _R0, _LO, _HI, _OFF, _KV_LEN, _KV_LO, _KV_HI = range(9)


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


def _item_meta(cu, kv_lens, num_seqs, num_blocks: int, block_q: int, sliding_window):
    """[M, 9] int32: each item's block, sequence, rows and KV block range, computed in XLA
    so the kernel reads plain scalars. Items past num_items get no rows and no KV blocks."""
    blk, seq, num_items = work_items(cu, num_seqs, num_blocks, block_q)
    ib = jax.vmap(lambda b, s: item_bounds(b, s, cu, kv_lens, block_q, BLOCK_KV, sliding_window))(blk, seq)
    live = jnp.arange(blk.shape[0], dtype=jnp.int32) < num_items
    z = jnp.zeros_like(blk)
    cols = [blk, seq, ib["r0"], jnp.where(live, ib["lo"], z), jnp.where(live, ib["hi"], z),
            ib["ctx"] - ib["q_start"], ib["kv_len"], jnp.where(live, ib["kv_lo"], z),
            jnp.where(live, ib["kv_hi"], z)]
    return jnp.stack([c.astype(jnp.int32) for c in cols], axis=1)


def _kernel(meta_ref,  # [M, 9] int32 (GMEM)
            pidx_ref,  # [S * P'] int32 page ids (GMEM)
            q_ref,  # [Hkv, num_blocks, ROWS, D] pre-scaled, g-major rows (GMEM)
            kv_ref,  # [num_pages, page_size, 2 * Hkv, D] bf16, or int8/fp8 (GMEM)
            *refs,  # see `names` below; [..] only with sinks / quantized pages
            block_q, page_size, pages_per_seq, sliding_window, soft_cap, sinks, quantized,
            interpret):
    names = (["sink_ref"] * sinks  # [Hkv, ROWS] f32 sink logits in log2 units (GMEM)
             + ["scale_ref"] * quantized  # [2 * Hkv, S * P' * page_size] f32 (GMEM)
             + ["o_ref",  # [Hkv, M, ROWS, D] (GMEM)
                "qo_smem",  # [ROWS, D]: q, then the output tile
                "k_ring", "v_ring"]  # [2, BLOCK_KV, D] page dtype: the KV ring
             + ["sink_smem"] * sinks  # [ROWS] f32
             + ["k_scales", "v_scales", "k_op", "v_op"] * quantized  # [2, BLOCK_KV] f32
             # rings of scales; [BLOCK_KV, D] bf16: the dequantized matmul operands
             + ["q_bar", "k_bars", "v_bars"])
    r = dict(zip(names, refs, strict=True))
    qo_smem = r["qo_smem"]
    h = lax.axis_index("h")
    i = lax.axis_index("i")
    head_dim = qo_smem.shape[-1]
    ppb = BLOCK_KV // page_size
    m_ = lambda c: meta_ref[i, c]
    seq, r0, lo, hi, off = m_(_SEQ), m_(_R0), m_(_LO), m_(_HI), m_(_OFF)
    kv_len, kv_lo, kv_hi = m_(_KV_LEN), m_(_KV_LO), m_(_KV_HI)

    def fetch(j, slot):  # KV block j (global index) into ring slot `slot`, page by page
        first = seq * pages_per_seq + j * ppb
        for x, c in (("k", 0), ("v", 1)):
            bar = r[f"{x}_bars"].at[slot]
            for p in range(ppb):
                plgpu.copy_gmem_to_smem(kv_ref.at[pidx_ref[first + p], :, 2 * h + c, :],
                                        r[f"{x}_ring"].at[slot, pl.ds(p * page_size, page_size)], bar)
            if quantized:  # the block's scales, contiguous in the gathered scale array
                plgpu.copy_gmem_to_smem(r["scale_ref"].at[2 * h + c, pl.ds(first * page_size, BLOCK_KV)],
                                        r[f"{x}_scales"].at[slot], bar)

    plgpu.copy_gmem_to_smem(q_ref.at[h, m_(_BLK)], qo_smem, r["q_bar"].at[0])
    if sinks:  # the same barrier, two arrivals
        plgpu.copy_gmem_to_smem(r["sink_ref"].at[h], r["sink_smem"], r["q_bar"].at[0])

    @pl.when(kv_lo < kv_hi)
    def _():
        fetch(kv_lo, 0)

    plgpu.barrier_wait(r["q_bar"].at[0])
    # Register layouts: the WGMMA fragment layout for tiles, its row reduction for m and l.
    # The interpreter has no layouts (no layout_cast rule on CPU): plain arrays there.
    wg = plgpu.Layout.WGMMA
    cast = (lambda x, layout: x) if interpret else plgpu.layout_cast
    iota = lambda shape, dim: plgpu.broadcasted_iota(jnp.int32, shape, dim,
                                                     layout=None if interpret else wg)

    def operand(x, j, slot):
        """K or V block j as the matmul's bf16 SMEM operand. Quantized: stored * scale per
        key in f32, rounded to bf16 (the oracle's order), into the one operand buffer.
        V rows past kv_len are zeroed (unused pages may hold NaN; 0 * NaN = NaN)."""
        ring = r[f"{x}_ring"].at[slot]
        if not quantized:
            if x == "v":
                @pl.when((j + 1) * BLOCK_KV > kv_len)
                def _():  # the sequence ends inside this block
                    v = ring[...]
                    key = j * BLOCK_KV + iota((BLOCK_KV, head_dim), 0)
                    ring[...] = jnp.where(key < kv_len, v, jnp.zeros((), v.dtype))
                    plgpu.commit_smem()
            return ring
        scale = cast(r[f"{x}_scales"].at[slot][...], wg.reduce(1))
        val = cast(ring[...], wg).astype(jnp.float32) * lax.broadcast_in_dim(scale, ring.shape, [0])
        if x == "v":
            key = j * BLOCK_KV + iota((BLOCK_KV, head_dim), 0)
            val = jnp.where(key < kv_len, val, 0.0)
        dst = r[f"{x}_op"]
        dst[...] = val.astype(dst.dtype)
        plgpu.commit_smem()
        return dst

    def step(j, carry):
        acc, m, l = carry
        slot = lax.rem(j - kv_lo, 2)

        @pl.when(j + 1 < kv_hi)
        def _():  # slot 1 - slot was last read by step j - 1, whose matmuls have finished
            fetch(j + 1, 1 - slot)

        plgpu.barrier_wait(r["k_bars"].at[slot])
        k = operand("k", j, slot)

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, qo_smem, k.transpose((1, 0)))
            return acc_ref[...]
        # The interpreter's wgmma takes neither a transposed operand, nor a register LHS,
        # nor run_state: interpreted, both matmuls are plain dots of the same operands.
        if interpret:
            sc = lax.dot_general(qo_smem[...], k[...], (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)
        else:
            sc = pl.run_scoped(qk, plgpu.ACC((ROWS, BLOCK_KV), jnp.float32))  # log2 units
        if soft_cap is not None:
            sc = (soft_cap * LOG2E) * jnp.tanh(sc / soft_cap)
        key_pos = j * BLOCK_KV + iota((ROWS, BLOCK_KV), 1)
        row_pos = r0 + lax.rem(iota((ROWS, BLOCK_KV), 0), jnp.int32(block_q)) + off
        vis = (key_pos <= row_pos) & (key_pos < kv_len)
        if sliding_window is not None:
            vis &= key_pos > row_pos - sliding_window
        sc = jnp.where(vis, sc, MASK_VALUE)
        m_new = jnp.maximum(m, sc.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(sc - lax.broadcast_in_dim(m_new, sc.shape, [0]))
        l = l * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

        plgpu.barrier_wait(r["v_bars"].at[slot])
        v = operand("v", j, slot)
        p16 = p.astype(qo_smem.dtype)
        if interpret:
            acc = acc + jnp.dot(p16, v[...], preferred_element_type=jnp.float32)
        else:  # wgmma accumulates into the rescaled acc in place (FA3)
            acc = pl.run_state(lambda a: plgpu.wgmma(a, p16, v))(plgpu.ACC.init(acc))
        return acc, m_new, l

    acc = cast(jnp.zeros((ROWS, head_dim), jnp.float32), wg)
    m = cast(jnp.full((ROWS,), MASK_VALUE, jnp.float32), wg.reduce(1))
    l = cast(jnp.zeros((ROWS,), jnp.float32), wg.reduce(1))
    acc, m, l = lax.fori_loop(kv_lo, kv_hi, step, (acc, m, l))
    if sinks:  # exp2(sink - m) joins each live row's denominator (m: the scores' max)
        sink = cast(r["sink_smem"][...], wg.reduce(1))
        l = jnp.where(l > 0, l + jnp.exp2(sink - m), 1.0)
    else:
        l = jnp.where(l > 0, l, 1.0)
    o = acc / lax.broadcast_in_dim(l, acc.shape, [0])
    tok = r0 + lax.rem(iota((ROWS, head_dim), 0), jnp.int32(block_q))
    o = jnp.where((tok >= lo) & (tok < hi), o, 0.0)
    qo_smem[...] = o.astype(qo_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qo_smem, r["o_ref"].at[h, i])
    plgpu.wait_smem_to_gmem(0)


def interpret_params():
    """Mosaic GPU's CPU interpreter (simulated SMEM, TMA, barriers, wgmma): how CI runs
    this kernel against the oracle without a GPU. jax 0.11 exports it as
    plgpu.InterpretGPUParams; 0.10 only under jax._src."""
    cls = getattr(plgpu, "InterpretGPUParams", None)
    if cls is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as cls
    return cls()


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "kv_shared",
                                             "interpret"))
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
    bq = ROWS // gp
    num_blocks = -(-num_tokens // bq)
    t_pad = num_blocks * bq
    num_slots, max_pages = page_indices.shape
    ppb = BLOCK_KV // page_size
    pages_per_seq = -(-max_pages // ppb) * ppb

    cu = sanitize_cu_q_lens(cu_q_lens.astype(jnp.int32), num_seqs)
    kv_lens = kv_lens.astype(jnp.int32)
    meta = _item_meta(cu, kv_lens, num_seqs, num_blocks, bq, sliding_window)
    num_items = meta.shape[0]
    pidx = jnp.clip(page_indices.astype(jnp.int32), 0, num_pages - 1)
    pidx = jnp.pad(pidx, ((0, 0), (0, pages_per_seq - max_pages))).reshape(-1)

    qs = (q.astype(jnp.float32) * (sm_scale * (1.0 if soft_cap is not None else LOG2E))).astype(q.dtype)
    qs = jnp.pad(qs, ((0, t_pad - num_tokens), (0, 0), (0, 0)))
    qs = qs.reshape(num_blocks, bq, num_kv_heads, group, head_dim)
    qs = jnp.pad(qs, ((0, 0), (0, 0), (0, 0), (0, gp - group), (0, 0)))
    qs = qs.transpose(2, 0, 3, 1, 4).reshape(num_kv_heads, num_blocks, ROWS, head_dim)

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
        operands.append(jnp.repeat(sink_rows, bq, axis=1))  # [Hkv, ROWS]
        scratch.append(plgpu.SMEM((ROWS,), jnp.float32))
    if quantized:
        # Each sequence's scales in page-table order, per combined head: a KV block's
        # scales are then BLOCK_KV contiguous f32 (one TMA copy). Costs a gather of the
        # live context's scales (1/D of its K/V bytes x 4) per call.
        scales = kv_scales.astype(jnp.float32)[pidx]  # [S * P', page_size, 2 * Hkv]
        operands.append(scales.transpose(2, 0, 1).reshape(combined, -1))
        scratch += [plgpu.SMEM((2, BLOCK_KV), jnp.float32)] * 2
        scratch += [smem((BLOCK_KV, head_dim), q.dtype)] * 2
    kernel = functools.partial(_kernel, block_q=bq, page_size=page_size, pages_per_seq=pages_per_seq,
                               sliding_window=sliding_window, soft_cap=soft_cap,
                               sinks=sinks is not None, quantized=quantized, interpret=interpret)
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((num_kv_heads, num_items, ROWS, head_dim), q.dtype),
        scratch_types=[
            *scratch,
            plgpu.Barrier(num_arrivals=2 if sinks is not None else 1, num_barriers=1),
            # One arrival per TMA copy: a page each, and the block's scales if quantized.
            plgpu.Barrier(num_arrivals=ppb + quantized, num_barriers=2),
            plgpu.Barrier(num_arrivals=ppb + quantized, num_barriers=2),
        ],
        grid=(num_kv_heads, num_items),
        grid_names=("h", "i"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params() if interpret else None,
    )(*operands)
    # Items of one query block own disjoint rows (the rest are zero): sum them per block.
    out = jax.ops.segment_sum(out.transpose(1, 0, 2, 3), meta[:, _BLK], num_segments=num_blocks)
    out = out.reshape(num_blocks, num_kv_heads, gp, bq, head_dim)[:, :, :group]
    out = out.transpose(0, 3, 1, 2, 4).reshape(t_pad, num_q_heads, head_dim)[:num_tokens]
    live = jnp.arange(num_tokens, dtype=jnp.int32) < cu[num_seqs[0]]
    return jnp.where(live[:, None, None], out, jnp.zeros((), out.dtype))
