"""The Mosaic GPU kernel body of ragged paged attention (see mosaic_gpu.py for the
design, the host-side preparation and the status: NEVER RUN ON A GPU).

One CTA = one (KV head, work item): q tile TMA-copied once, KV blocks of BLOCK_KV keys
through a two-slot TMA ring, wgmma matmuls with f32 accumulators, online softmax in
registers, the item's output tile TMA-stored. `interpret=True` is the form Mosaic GPU's
CPU interpreter can run: no register layouts, plain dots instead of wgmma.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxfill.pallas_kernels.ragged_paged_attention.online_softmax import MASK_VALUE
from jaxfill.pallas_kernels.ragged_paged_attention.window import in_window

LOG2E = math.log2(math.e)
ROWS = 64  # one warpgroup's wgmma M
BLOCK_KV = 64
# Per-item scalars the XLA side computes (columns of `meta`).
_BLK, _SEQ, _R0, _LO, _HI, _OFF, _KV_LEN, _KV_LO, _KV_HI = range(9)


def kernel(meta_ref,  # [M, 9] int32 (GMEM)
            pidx_ref,  # [S * P'] int32 page ids (GMEM)
            q_ref,  # [Hkv * n, num_blocks, ROWS, D] pre-scaled, g-major rows (GMEM)
            kv_ref,  # [num_pages, page_size, 2 * Hkv, D] bf16, or int8/fp8 (GMEM)
            *refs,  # see `names` below; [..] only with sinks / quantized pages
            block_q, tiles_per_kv_head, page_size, pages_per_seq, sliding_window, attention_chunk, soft_cap,
            sinks, quantized, interpret):
    names = (["sink_ref"] * sinks  # [Hkv * n, ROWS] f32 sink logits in log2 units (GMEM)
             + ["scale_ref"] * quantized  # [2 * Hkv, S * P' * page_size] f32 (GMEM)
             + ["o_ref",  # [Hkv * n, M, ROWS, D] (GMEM)
                "qo_smem",  # [ROWS, D]: q, then the output tile
                "k_ring", "v_ring"]  # [2, BLOCK_KV, D] page dtype: the KV ring
             + ["sink_smem"] * sinks  # [ROWS] f32
             + ["k_scales", "v_scales", "k_op", "v_op"] * quantized  # [2, BLOCK_KV] f32
             # rings of scales; [BLOCK_KV, D] bf16: the dequantized matmul operands
             + ["q_bar", "k_bars", "v_bars"])
    r = dict(zip(names, refs, strict=True))
    qo_smem = r["qo_smem"]
    t = lax.axis_index("t")  # the q tile: query heads [t % n * 64/block_q, ...) of KV head h
    h = lax.div(t, jnp.int32(tiles_per_kv_head))
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

    plgpu.copy_gmem_to_smem(q_ref.at[t, m_(_BLK)], qo_smem, r["q_bar"].at[0])
    if sinks:  # the same barrier, two arrivals
        plgpu.copy_gmem_to_smem(r["sink_ref"].at[t], r["sink_smem"], r["q_bar"].at[0])

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
        if interpret:  # plain SMEM reads: fenced before a later TMA refills the slot
            sc = lax.dot_general(qo_smem[...], k[...], (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)
            plgpu.commit_smem()
        else:
            sc = pl.run_scoped(qk, plgpu.ACC((ROWS, BLOCK_KV), jnp.float32))  # log2 units
        if soft_cap is not None:
            sc = (soft_cap * LOG2E) * jnp.tanh(sc / soft_cap)
        key_pos = j * BLOCK_KV + iota((ROWS, BLOCK_KV), 1)
        row_pos = r0 + lax.rem(iota((ROWS, BLOCK_KV), 0), jnp.int32(block_q)) + off
        vis = (key_pos <= row_pos) & (key_pos < kv_len)
        window = in_window(key_pos, row_pos, sliding_window, attention_chunk)
        if window is not None:
            vis &= window
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
            plgpu.commit_smem()
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
    plgpu.copy_smem_to_gmem(qo_smem, r["o_ref"].at[t, i])
    plgpu.wait_smem_to_gmem(0)
