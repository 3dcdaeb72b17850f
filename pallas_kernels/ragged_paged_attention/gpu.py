"""Ragged paged attention as a Pallas GPU kernel (Triton lowering).

Why Triton: the installed JAX (0.10.x) offers two Pallas GPU backends. Mosaic GPU needs
Hopper-class (sm_90+) hardware and warpgroup-level code; the Triton lowering runs on any
CUDA GPU JAX supports (Ampere, Ada, Hopper) and in `interpret=True` mode on CPU, which is
how CI checks it. The Triton backend is deprecated from JAX 0.11; when the project moves
past 0.10 this file gets a Mosaic GPU twin and `resolve_impl` picks by device.

Grid (Hkv, items) over the same (query block, sequence) item table as the XLA and TPU
impls (`work_items.work_items`); all programs are independent. One program: the [Gp*block_q, D]
stacked q operand of one KV head (Gp = G padded to a power of two, Triton tiles are
powers of two), a `fori_loop` over KV blocks [kv_lo, kv_hi) (nothing above the causal
diagonal or before the window), each KV block gathered from `block_kv / page_size` pages
through the page table, online softmax in f32 (exp2 with log2(e) folded into q), and a
masked store of only the rows that belong to the item's sequence (a query block that
straddles two sequences is written by two programs, disjoint rows). K and V are two
BlockSpec views of the same page array (combined head 2h and 2h+1; both entry h for shared
pages, where V is K: latent attention), so nothing is copied.
K/V past kv_len are zeroed with `where`: unused pages may hold NaN. Quantized pages
(int8 / fp8) come with two more views, of the scales at combined head 2h and 2h + 1
(`[num_pages, page_size]` each); each gathered KV block is dequantized in registers.
Attention sinks (gpt-oss) come as one more view, `[Gp*block_q]` f32 per KV head: each
stacked row's sink logit already in log2 units, so the kernel only adds exp2(sink - m)
to the denominator at the end.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxfill.pallas_kernels.ragged_paged_attention.block_sizes import gpu_block_sizes
from jaxfill.pallas_kernels.ragged_paged_attention.online_softmax import MASK_VALUE
from jaxfill.pallas_kernels.ragged_paged_attention.window import in_window
from jaxfill.pallas_kernels.ragged_paged_attention.work_items import item_bounds, sanitize_cu_q_lens, work_items

LOG2E = math.log2(math.e)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _kernel(kv_lens_ref, pidx_ref, cu_ref, item_block_ref, item_seq_ref, num_items_ref,
            q_ref,  # [Gp, T_pad, D] (KV head h)
            k_ref,  # [num_pages, page_size, D] (combined head 2h)
            v_ref,  # [num_pages, page_size, D] (combined head 2h + 1)
            *refs,  # [ks_ref, vs_ref [num_pages, page_size] f32 if quantized],
                    # [sink_ref [Gp*block_q] f32 log2 units if sinks], o_ref [Gp, T_pad, D]
            block_q, block_kv, pages_per_block, pages_per_seq, sliding_window, attention_chunk, soft_cap,
            quantized, sinks):
    refs = list(refs)
    ks_ref, vs_ref = (refs.pop(0), refs.pop(0)) if quantized else (None, None)
    sink_ref = refs.pop(0) if sinks else None
    (o_ref,) = refs
    i = pl.program_id(1)
    group, _, head_dim = q_ref.shape
    rows = group * block_q

    @pl.when(i < num_items_ref[0])
    def _item():
        b = item_block_ref[i]
        s = item_seq_ref[i]
        ib = item_bounds(b, s, cu_ref, kv_lens_ref, block_q, block_kv, sliding_window,
                         attention_chunk=attention_chunk)
        kv_len = ib["kv_len"]
        r0 = ib["r0"]
        q = q_ref[:, pl.ds(r0, block_q), :].reshape(rows, head_dim)
        row_tok = r0 + lax.rem(jnp.arange(rows, dtype=jnp.int32), jnp.int32(block_q))  # g-major
        row_pos = ib["ctx"] + row_tok - ib["q_start"]

        def step(j, carry):
            m, l, acc = carry
            ids = pidx_ref[pl.ds(s * pages_per_seq + j * pages_per_block, pages_per_block)]
            k = k_ref[ids].reshape(block_kv, head_dim)
            v = v_ref[ids].reshape(block_kv, head_dim)
            if quantized:
                k = (k.astype(jnp.float32) * ks_ref[ids].reshape(block_kv, 1)).astype(q.dtype)
                v = (v.astype(jnp.float32) * vs_ref[ids].reshape(block_kv, 1)).astype(q.dtype)
            key_pos = j * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
            in_len = key_pos < kv_len
            k = jnp.where(in_len[:, None], k, jnp.zeros((), k.dtype))
            v = jnp.where(in_len[:, None], v, jnp.zeros((), v.dtype))
            sc = plgpu.dot(q, k, trans_b=True).astype(jnp.float32)  # [rows, bk], log2 units
            if soft_cap is not None:
                sc = (soft_cap * LOG2E) * jnp.tanh(sc / soft_cap)
            vis = (key_pos[None, :] <= row_pos[:, None]) & in_len[None, :]
            window = in_window(key_pos[None, :], row_pos[:, None], sliding_window, attention_chunk)
            if window is not None:
                vis &= window
            sc = jnp.where(vis, sc, MASK_VALUE)
            m_new = jnp.maximum(m, sc.max(axis=-1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(sc - m_new[:, None])
            l = alpha * l + p.sum(axis=-1)
            acc = alpha[:, None] * acc + plgpu.dot(p.astype(v.dtype), v).astype(jnp.float32)
            return m_new, l, acc

        carry = (jnp.full((rows,), MASK_VALUE, jnp.float32),
                 jnp.zeros((rows,), jnp.float32),
                 jnp.zeros((rows, head_dim), jnp.float32))
        m, l, acc = lax.fori_loop(ib["kv_lo"], ib["kv_hi"], step, carry)
        if sinks:  # exp2, not a polynomial: sink - m may be positive
            o = acc / jnp.where(l > 0, l + jnp.exp2(sink_ref[...] - m), 1.0)[:, None]
        else:
            o = acc / jnp.where(l > 0, l, 1.0)[:, None]
        o = o.reshape(group, block_q, head_dim).astype(o_ref.dtype)
        tok = r0 + jnp.arange(block_q, dtype=jnp.int32)
        mine = (tok >= ib["lo"]) & (tok < ib["hi"])
        mask = jnp.broadcast_to(mine[None, :, None], o.shape)
        plgpu.store(o_ref.at[:, pl.ds(r0, block_q), :], o, mask=mask)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "attention_chunk", "soft_cap",
                                             "block_q", "block_kv", "interpret",
                                             "num_warps", "num_stages", "kv_shared"))
def ragged_paged_attention_gpu(
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
    interpret: bool | None = None,  # None: interpret unless running on a GPU
    num_warps: int | None = None,
    num_stages: int | None = None,
    kv_scales: jax.Array | None = None,  # [num_pages, page_size, 2 * Hkv] f32 (int8/fp8 pages)
    sinks: jax.Array | None = None,  # [Hq] f32 attention sinks, natural-log units
    kv_shared: bool = False,  # pages [.., Hkv, D] hold K only; V is K (latent attention)
) -> jax.Array:  # [T, Hq, D]
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, combined, _ = kv_pages.shape
    per = 1 if kv_shared else 2  # page entries per KV head: V views the K entry when shared
    num_kv_heads = combined // per
    group = num_q_heads // num_kv_heads
    gp = _next_pow2(group)
    num_slots, max_pages = page_indices.shape
    sizes = gpu_block_sizes(num_tokens, num_slots, gp, head_dim, q.dtype.itemsize, page_size)
    bq = block_q or sizes.block_q
    bk = block_kv or max(sizes.block_kv, page_size)
    if bk % page_size or bk & (bk - 1) or (gp * bq) & (gp * bq - 1):
        raise ValueError(f"pallas_gpu needs power-of-two tiles: block_kv {bk} (a multiple of "
                         f"page_size {page_size}), rows {gp}x{bq}")
    ppb = bk // page_size
    num_blocks = -(-num_tokens // bq)
    t_pad = num_blocks * bq
    pages_per_seq = -(-max_pages // ppb) * ppb
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if head_dim & (head_dim - 1) and not interpret:
        # Triton tiles must be powers of two, and a 96-wide head (Phi-3) would need every
        # page padded to 128: refused by name; the engine's warm-up check serves it with xla.
        raise ValueError(f"pallas_gpu needs a power-of-two head_dim, got {head_dim}; use attention_impl='xla'")

    cu = sanitize_cu_q_lens(cu_q_lens.astype(jnp.int32), num_seqs)
    kv_lens = kv_lens.astype(jnp.int32)
    item_block, item_seq, num_items = work_items(cu, num_seqs, num_blocks, bq)
    pidx = jnp.clip(page_indices.astype(jnp.int32), 0, num_pages - 1)
    pidx = jnp.pad(pidx, ((0, 0), (0, pages_per_seq - max_pages))).reshape(-1)

    qs = (q.astype(jnp.float32) * (sm_scale * (1.0 if soft_cap is not None else LOG2E)))
    qs = qs.astype(q.dtype)
    qs = jnp.pad(qs, ((0, t_pad - num_tokens), (0, 0), (0, 0)))
    qs = qs.reshape(t_pad, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)
    qs = jnp.pad(qs, ((0, 0), (0, gp - group), (0, 0), (0, 0)))  # [Hkv, Gp, T_pad, D]

    whole = lambda *shape: pl.BlockSpec(shape, lambda h, i: (0,) * len(shape))
    meta = [kv_lens, pidx, cu, item_block, item_seq, num_items.reshape(1)]
    in_specs = [whole(*a.shape) for a in meta] + [
        pl.BlockSpec((None, gp, t_pad, head_dim), lambda h, i: (h, 0, 0, 0)),
        pl.BlockSpec((num_pages, page_size, None, head_dim), lambda h, i: (0, 0, per * h, 0)),
        pl.BlockSpec((num_pages, page_size, None, head_dim),
                     lambda h, i: (0, 0, per * h + per - 1, 0)),
    ]
    operands = [*meta, qs, kv_pages, kv_pages]
    if kv_scales is not None:
        in_specs += [pl.BlockSpec((num_pages, page_size, None), lambda h, i: (0, 0, per * h)),
                     pl.BlockSpec((num_pages, page_size, None),
                                  lambda h, i: (0, 0, per * h + per - 1))]
        operands += [kv_scales, kv_scales]
    if sinks is not None:
        # Per stacked row (g-major, like q's rows), in the scores' log2 units; padded heads
        # (group..Gp) get 0, their rows are never stored.
        sink_rows = (sinks.astype(jnp.float32) * LOG2E).reshape(num_kv_heads, group)
        sink_rows = jnp.pad(sink_rows, ((0, 0), (0, gp - group)))
        sink_rows = jnp.repeat(sink_rows, bq, axis=1)  # [Hkv, Gp*bq]
        in_specs.append(pl.BlockSpec((None, gp * bq), lambda h, i: (h, 0)))
        operands.append(sink_rows)
    kernel = functools.partial(
        _kernel, block_q=bq, block_kv=bk, pages_per_block=ppb, pages_per_seq=pages_per_seq,
        sliding_window=sliding_window, attention_chunk=attention_chunk, soft_cap=soft_cap,
        quantized=kv_scales is not None,
        sinks=sinks is not None)
    compiler_params = None
    if not interpret:
        warps = num_warps or (4 if gp * bq * head_dim <= 64 * 128 else 8)
        compiler_params = plgpu.CompilerParams(num_warps=warps, num_stages=num_stages or 2)
    out = pl.pallas_call(
        kernel,
        grid=(num_kv_heads, num_blocks + num_slots),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, gp, t_pad, head_dim), lambda h, i: (h, 0, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(qs.shape, q.dtype),
        compiler_params=compiler_params,
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(*operands)
    out = out[:, :group].transpose(2, 0, 1, 3).reshape(t_pad, num_q_heads, head_dim)
    out = out[:num_tokens]
    # Rows no item owns (padding tokens) were never stored.
    live = jnp.arange(num_tokens, dtype=jnp.int32) < cu[num_seqs[0]]
    return jnp.where(live[:, None, None], out, jnp.zeros((), out.dtype))
