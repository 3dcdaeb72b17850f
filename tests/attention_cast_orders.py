"""Where each ragged paged attention impl rounds to bf16, as oracle `CastOrder`s.

Read off the impls (pallas_kernels/ragged_paged_attention/):
  reference   q, K, V upcast to f32; all math f32; only the output is rounded.
  xla, gpu    q * sm_scale * log2(e) (sm_scale alone with a soft cap) in f32, rounded to
              bf16, then the QK matmul; P rounded before the PV matmul against the running
              max of an online softmax; row sums of the unrounded P; output rounded.
  mosaic_gpu  the same (KV blocks of 64 keys).
  pallas_tpu  the same with q * sm_scale (natural-log units).
KV block sizes come from block_sizes.py; the xla impl serves decode sequences (one new
token, when the batch has more than one token) on its sequence-batched path, whose KV
blocks are kv_block(page_size, 128) keys.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from attention_oracle import CastOrder
from jaxfill.pallas_kernels.ragged_paged_attention import block_sizes as bs

LOG2E = math.log2(math.e)


def _block_kv(impl, batch):
    """KV block size per sequence slot (a tuple), as the impl picks it."""
    t, hq, d = batch.q.shape
    _, ps, combined, _ = batch.kv_pages.shape
    group = hq // (combined // 2)
    slots, max_pages = batch.page_indices.shape
    item = np.dtype(batch.q.dtype).itemsize
    if impl == "xla":
        items = bs.xla_block_sizes(t, slots, group, d, item, ps).block_kv
        short = bs.kv_block(ps, 128)
        q_lens = np.diff(batch.cu_q_lens)
        return tuple(short if (ql <= 1 and t > 1) else items for ql in q_lens)
    if impl == "pallas_tpu":
        return (bs.tpu_block_sizes(t, slots, d, item, ps, max_pages).block_kv,) * slots
    if impl == "pallas_gpu":
        gp = 1 << (group - 1).bit_length()
        return (max(bs.gpu_block_sizes(t, slots, gp, d, item, ps).block_kv, ps),) * slots
    if impl == "mosaic_gpu":  # KV blocks of 64 keys (mosaic_gpu.BLOCK_KV), whatever the shape
        return (64,) * slots
    raise ValueError(impl)


def cast_order(impl, batch, *, sm_scale, soft_cap=None) -> CastOrder:
    """The impl's own cast order for this batch."""
    if impl == "reference":
        return CastOrder()
    log2 = 1.0 if (soft_cap is not None or impl == "pallas_tpu") else LOG2E
    return CastOrder(q_prescale=sm_scale * log2, round_p=True, block_kv=_block_kv(impl, batch))


def wrong_orders(order: CastOrder, *, sm_scale) -> dict[str, CastOrder]:
    """Plausible mistakes, one rounding site each: the tolerance must reject every one."""
    return {
        "p_rounding_flipped": dataclasses.replace(order, round_p=not order.round_p),
        "scores_in_bf16": dataclasses.replace(order, round_scores=True),
        "q_scale_flipped": dataclasses.replace(
            order, q_prescale=None if order.q_prescale else sm_scale * LOG2E),
    }


def bf16_mismatch(out,  # [T, Hq, D] the impl's output, any float dtype
                  ref,  # [T, Hq, D] float64 oracle with round_out
                  live):  # [T] bool
    """(fraction of live elements that differ, largest difference in ulps of ref)."""
    out = np.asarray(out, np.float64)[live]
    ref = ref[live]
    if ref.size == 0:
        return 0.0, 0.0
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(ref), 1e-38))) - 7)  # bf16: 8-bit mantissa
    return float(np.mean(out != ref)), float(np.max(np.abs(out - ref) / ulp))
