"""Ragged paged attention as a Pallas Mosaic TPU kernel.

Grid (Hkv, items): one grid step = one KV head x one (query block, sequence) item (see
`work_items.work_items`). All metadata is scalar-prefetched into SMEM (kv_lens, page_indices,
cu_q_lens, num_seqs, and the item table derived from them), so the q/out BlockSpecs can
follow the item table and the kernel can chase page ids.

q arrives pre-arranged as [Hkv, G, T, D]: the q block of one item is [G, block_q, D] and
is used as one stacked [G*block_q, D] MXU operand. K/V pages stay in HBM (pl.ANY); each KV
block is `block_kv / page_size` pages, copied with `make_async_copy` into a two-slot VMEM
buffer: block j+1 is in flight while block j is computed. The KV loop runs over
[kv_lo, kv_hi) only (causal end, sliding-window start), so blocks above the diagonal are
never fetched nor computed. Online softmax in f32; K/V past kv_len are zeroed with
`where` (unused pages may hold NaN).

Consecutive items may share a query block (a block straddling two sequences); the out
block stays resident across them (sequential "arbitrary" axis), is zeroed by the block's
first item, and each item writes only its own rows. Items past the live count repeat the
last real one, so they touch no new block and compute nothing.

Blocks holding only padding tokens are never visited; the wrapper zeroes those rows.

Quantized pages (int8 / fp8): each page's scales `[page_size, 2*Hkv]` (contiguous) ride
in the same double buffer with their own DMA; head h's K and V scale columns are picked
with a one-hot sum (no dynamic lane index) and the block is dequantized in VMEM.

Attention sinks (gpt-oss): a `[G*block_q, 1]` f32 VMEM block per KV head, each stacked
row's sink logit (natural-log units, like the scores here), the shape of the running max
and sum; its block index depends on the head only, so it is fetched once per head. The
kernel adds exp(sink - m) to the denominator at the end.

Off TPU the kernel runs under the TPU interpreter with race detection on.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxfill.pallas_kernels.ragged_paged_attention.block_sizes import tpu_block_sizes
from jaxfill.pallas_kernels.ragged_paged_attention.online_softmax import MASK_VALUE
from jaxfill.pallas_kernels.ragged_paged_attention.window import in_window
from jaxfill.pallas_kernels.ragged_paged_attention.work_items import item_bounds, sanitize_cu_q_lens, work_items


def interpret_params():
    """What the kernel runs under off TPU: the TPU interpreter, DMAs executed on wait,
    out-of-bounds reads raising, uninitialized memory NaN, race detection on."""
    return pltpu.InterpretParams(detect_races=True, dma_execution_mode="on_wait",
                                 out_of_bounds_reads="raise", uninitialized_memory="nan")


def races_found() -> bool:
    """True when the interpreter's race detector flagged the last interpreted kernel."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc

    return bool(ipc.races is not None and ipc.races.races_found)


def _kernel(kv_lens_ref, pidx_ref, cu_ref, num_seqs_ref, item_block_ref, item_seq_ref,
            num_items_ref,  # scalar prefetch (SMEM)
            q_ref,  # [G, bq, D] block
            kv_hbm,  # [num_pages, page_size, 2*Hkv, D] in HBM
            *refs,  # [scales_hbm [num_pages, page_size, 2*Hkv] f32 if quantized], [sink_ref
                    # [G*bq, 1] f32 if sinks], o_ref [G, bq, D], k_buf, v_buf [2, ppb,
                    # page_size, D] VMEM, [s_buf [2, ppb, page_size, 2*Hkv] f32], sems DMA
                    # [2 or 3 (k/v/scales), 2 (slot)]
            block_q, block_kv, pages_per_block, pages_per_seq, sliding_window, attention_chunk, soft_cap,
            quantized, sinks, kv_shared):
    del num_seqs_ref  # folded into cu (sanitized) and the item table
    refs = list(refs)
    scales_hbm = refs.pop(0) if quantized else None
    sink_ref = refs.pop(0) if sinks else None
    if quantized:
        o_ref, k_buf, v_buf, s_buf, sems = refs
    else:
        (o_ref, k_buf, v_buf, sems), s_buf = refs, None
    h = pl.program_id(0)
    i = pl.program_id(1)
    group, bq, head_dim = q_ref.shape
    rows = group * bq
    b = item_block_ref[i]
    s = item_seq_ref[i]
    prev_b = item_block_ref[jnp.maximum(i - 1, 0)]

    @pl.when((i == 0) | (prev_b != b))
    def _zero():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    per = 1 if kv_shared else 2  # page entries per KV head
    k_col, v_col = per * h, per * h + per - 1

    def copies(j, slot):
        out = []
        for p in range(pages_per_block):
            page = pidx_ref[s * pages_per_seq + j * pages_per_block + p]
            out.append(pltpu.make_async_copy(kv_hbm.at[page, :, k_col, :],
                                             k_buf.at[slot, p], sems.at[0, slot]))
            if not kv_shared:  # shared pages: V is the K block already copied
                out.append(pltpu.make_async_copy(kv_hbm.at[page, :, v_col, :],
                                                 v_buf.at[slot, p], sems.at[1, slot]))
            if quantized:
                out.append(pltpu.make_async_copy(scales_hbm.at[page], s_buf.at[slot, p],
                                                 sems.at[2, slot]))
        return out

    @pl.when(i < num_items_ref[0])
    def _item():
        ib = item_bounds(b, s, cu_ref, kv_lens_ref, block_q, block_kv, sliding_window,
                         attention_chunk=attention_chunk)
        kv_lo, kv_hi, kv_len = ib["kv_lo"], ib["kv_hi"], ib["kv_len"]
        q = q_ref[...].reshape(rows, head_dim)  # g-major rows: row r -> token r % bq
        row_tok = ib["r0"] + lax.rem(lax.broadcasted_iota(jnp.int32, (rows, block_kv), 0),
                                     jnp.int32(bq))
        row_pos = ib["ctx"] + row_tok - ib["q_start"]

        @pl.when(kv_lo < kv_hi)
        def _first():
            for c in copies(kv_lo, lax.rem(kv_lo, 2)):
                c.start()

        def step(j, carry):
            m, l, acc = carry
            slot = lax.rem(j, 2)

            @pl.when(j + 1 < kv_hi)
            def _prefetch():
                for c in copies(j + 1, 1 - slot):
                    c.start()

            for c in copies(j, slot):
                c.wait()
            k = k_buf[slot].reshape(block_kv, head_dim)
            v = (k_buf if kv_shared else v_buf)[slot].reshape(block_kv, head_dim)
            if quantized:
                sc_all = s_buf[slot].reshape(block_kv, s_buf.shape[-1])  # [bk, 2*Hkv]
                col = lax.broadcasted_iota(jnp.int32, sc_all.shape, 1)
                k_scale = jnp.sum(jnp.where(col == k_col, sc_all, 0.0), axis=1, keepdims=True)
                v_scale = jnp.sum(jnp.where(col == v_col, sc_all, 0.0), axis=1, keepdims=True)
                k = (k.astype(jnp.float32) * k_scale).astype(q.dtype)
                v = (v.astype(jnp.float32) * v_scale).astype(q.dtype)
            key_col = j * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0)
            k = jnp.where(key_col < kv_len, k, jnp.zeros((), k.dtype))
            v = jnp.where(key_col < kv_len, v, jnp.zeros((), v.dtype))
            sc = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)  # [rows, bk]
            if soft_cap is not None:
                sc = soft_cap * jnp.tanh(sc / soft_cap)
            key_pos = j * block_kv + lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1)
            vis = (key_pos <= row_pos) & (key_pos < kv_len)
            window = in_window(key_pos, row_pos, sliding_window, attention_chunk)
            if window is not None:
                vis &= window
            sc = jnp.where(vis, sc, MASK_VALUE)
            m_new = jnp.maximum(m, sc.max(axis=-1, keepdims=True))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(sc - m_new)
            l = alpha * l + p.sum(axis=-1, keepdims=True)
            pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
            return m_new, l, alpha * acc + pv

        carry = (jnp.full((rows, 1), MASK_VALUE, jnp.float32),
                 jnp.zeros((rows, 1), jnp.float32),
                 jnp.zeros((rows, head_dim), jnp.float32))
        m, l, acc = lax.fori_loop(kv_lo, kv_hi, step, carry)
        if sinks:
            o = acc / jnp.where(l > 0, l + jnp.exp(sink_ref[...] - m), 1.0)
        else:
            o = acc / jnp.where(l > 0, l, 1.0)
        o = o.reshape(group, bq, head_dim)
        tok = ib["r0"] + lax.broadcasted_iota(jnp.int32, (group, bq, head_dim), 1)
        mine = (tok >= ib["lo"]) & (tok < ib["hi"])
        o_ref[...] = jnp.where(mine, o.astype(o_ref.dtype), o_ref[...])


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "attention_chunk", "soft_cap",
                                             "block_q", "block_kv", "interpret", "kv_shared"))
def ragged_paged_attention_tpu(
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
    interpret=None,  # None: auto (interpreter off TPU); False; or InterpretParams
    kv_scales: jax.Array | None = None,  # [num_pages, page_size, 2 * Hkv] f32 (int8/fp8 pages)
    sinks: jax.Array | None = None,  # [Hq] f32 attention sinks, natural-log units
    kv_shared: bool = False,  # pages [.., Hkv, D] hold K only; V is K (latent attention)
) -> jax.Array:  # [T, Hq, D]
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, combined, _ = kv_pages.shape
    num_kv_heads = combined if kv_shared else combined // 2
    group = num_q_heads // num_kv_heads
    num_slots, max_pages = page_indices.shape
    sizes = tpu_block_sizes(num_tokens, num_slots, head_dim, q.dtype.itemsize, page_size,
                            max_pages)
    bq = block_q or sizes.block_q
    bk = block_kv or sizes.block_kv
    if bk % page_size:
        raise ValueError(f"block_kv {bk} must be a multiple of page_size {page_size}")
    ppb = bk // page_size
    num_blocks = -(-num_tokens // bq)
    t_pad = num_blocks * bq
    pages_per_seq = -(-max_pages // ppb) * ppb
    if interpret is None:
        interpret = False if jax.default_backend() == "tpu" else interpret_params()

    cu = sanitize_cu_q_lens(cu_q_lens.astype(jnp.int32), num_seqs)
    kv_lens = kv_lens.astype(jnp.int32)
    item_block, item_seq, num_items = work_items(cu, num_seqs, num_blocks, bq)
    pidx = jnp.clip(page_indices.astype(jnp.int32), 0, num_pages - 1)
    pidx = jnp.pad(pidx, ((0, 0), (0, pages_per_seq - max_pages))).reshape(-1)

    qs = (q.astype(jnp.float32) * sm_scale).astype(q.dtype)
    qs = jnp.pad(qs, ((0, t_pad - num_tokens), (0, 0), (0, 0)))
    qs = qs.reshape(t_pad, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)

    def q_map(h, i, kv_lens_ref, pidx_ref, cu_ref, ns_ref, iblk_ref, iseq_ref, nit_ref):
        return (h, 0, iblk_ref[i], 0)

    block = pl.BlockSpec((None, group, bq, head_dim), q_map)
    kernel = functools.partial(
        _kernel, block_q=bq, block_kv=bk, pages_per_block=ppb, pages_per_seq=pages_per_seq,
        sliding_window=sliding_window, attention_chunk=attention_chunk, soft_cap=soft_cap,
        quantized=kv_scales is not None,
        sinks=sinks is not None, kv_shared=kv_shared)
    kv_buf = pltpu.VMEM((2, ppb, page_size, head_dim), kv_pages.dtype)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    if kv_scales is None:
        in_specs, scratch, operands = [block, hbm], [kv_buf, kv_buf], (qs, kv_pages)
    else:
        in_specs = [block, hbm, hbm]
        scratch = [kv_buf, kv_buf, pltpu.VMEM((2, ppb, page_size, combined), kv_scales.dtype)]
        operands = (qs, kv_pages, kv_scales)
    if sinks is not None:
        # One sink per stacked row (g-major, like q's rows): [Hkv, G*bq, 1].
        sink_rows = jnp.repeat(sinks.astype(jnp.float32).reshape(num_kv_heads, group), bq, axis=1)
        in_specs = [*in_specs, pl.BlockSpec((None, group * bq, 1),
                                            lambda h, i, *_: (h, 0, 0))]
        operands = (*operands, sink_rows[..., None])
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=7,
            grid=(num_kv_heads, num_blocks + num_slots),
            in_specs=in_specs,
            out_specs=block,
            scratch_shapes=[*scratch, pltpu.SemaphoreType.DMA((len(scratch), 2))],
        ),
        out_shape=jax.ShapeDtypeStruct(qs.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(kv_lens, pidx, cu, num_seqs.astype(jnp.int32), item_block, item_seq,
      num_items.reshape(1), *operands)
    out = out.transpose(2, 0, 1, 3).reshape(t_pad, num_q_heads, head_dim)[:num_tokens]
    # Blocks holding only padding tokens are never visited: their HBM rows are undefined.
    live = jnp.arange(num_tokens, dtype=jnp.int32) < cu[num_seqs[0]]
    return jnp.where(live[:, None, None], out, jnp.zeros((), out.dtype))
