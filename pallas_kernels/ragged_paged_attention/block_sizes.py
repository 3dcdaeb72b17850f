"""Tuned block sizes, keyed by backend, shape and dtype. Never queried from the device.

Every entry was picked by a benchmark in `benchmarks/` (see RESULTS.md); the lookup
falls back to the nearest smaller key, so unseen shapes still get a sane size.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_q: int  # query tokens per block (rows of one sequence segment)
    block_kv: int  # keys per KV block (a multiple of page_size, or one page)


def _pow2_at_most(x: int) -> int:
    p = 1
    while p * 2 <= x:
        p *= 2
    return p


def _pow2_at_least(x: int) -> int:
    p = 1
    while p < x:
        p *= 2
    return p


def kv_block(page_size: int, target: int) -> int:
    """Largest multiple of page_size <= target (at least one page)."""
    return max(page_size, (target // page_size) * page_size)


# ---------------------------------------------------------------------------------------
# XLA (CPU default, GPU fallback). Measured on a 2-core Zen 3 (512 KiB L2 per core):
# the score tile [G*block_q, block_kv] f32 plus the K/V blocks should stay in L2; at
# G*block_q = 512..1024 rows, block_kv = 128..256 measured best for head_dim 64..128
# (1024 x 256 beat 512 x 256 by ~15% at S=2048, Hq=8/Hkv=2/D=64 f32, despite the 2 MB
# score tile; a shared, noisy machine: see RESULTS.md).
# key: (head_dim, itemsize) -> (max rows of the stacked [G*block_q, D] operand, block_kv)
MIN_PREFILL_BLOCK_Q = 256
# block_kv never exceeds max(block_q, this): a short prompt's keys fit one block, and with
# block_q == block_kv the diagonal splits into row chunks. 128-token prefill, one core:
# 0.47 ms (128 x 128) vs 0.88 ms (128 x 256); torch SDPA 0.47 ms (RESULTS.md, issue 17).
MIN_BLOCK_KV = 128
_XLA_TABLE = {
    (64, 4): (1024, 256),
    (128, 4): (512, 128),
    (256, 4): (256, 128),
    (64, 2): (512, 256),
    (128, 2): (512, 256),
    (256, 2): (256, 128),
}


def xla_parallel_loops(backend: str, num_kv_heads: int, group: int) -> int:
    """Independent loops the XLA impl splits the heads into (the `par` knob).

    The idea: XLA CPU could run independent while loops on separate cores instead of
    relying on intra-op threading of the small ops inside one loop. Measured with
    jax 0.10.2 it does not (two independent loops take 2x one loop, also with
    --xla_cpu_enable_concurrency_optimized_scheduler), and splitting halves each op, so
    the default is one loop everywhere. Real 2-core parallelism comes from the engine's
    mesh: two CPU devices, tensor parallel over KV heads.
    """
    del backend, num_kv_heads, group
    return 1


def xla_diagonal_splits(block_q: int, block_kv: int, page_size: int, itemsize: int,
                        target: int = 4) -> int:
    """Row chunks the XLA impl cuts the causal-diagonal step into (see xla_items.attend_items).

    Only with block_q == block_kv (the diagonal is then one triangle) and f32 operands:
    with bf16 P is rounded per KV window, and the chunks' windows differ from whole
    blocks, so the cast order in tests/attention_cast_orders.py would no longer hold.
    Each chunk must keep >= 64 rows and whole pages per window; else 1 (no split).
    """
    if block_q != block_kv or itemsize < 4:
        return 1
    n = target
    while n > 1 and (block_q % n or block_q // n < 64 or block_kv % (n * page_size)):
        n //= 2
    return n


def xla_block_sizes(num_tokens: int, num_seq_slots: int, group: int, head_dim: int,
                    itemsize: int, page_size: int) -> BlockSizes:
    """Static choice from static shapes.

    block_q follows the average tokens per sequence slot, so a decode batch (T == S) gets
    small query blocks (little waste per sequence) and a long prefill gets big ones.
    """
    key = (head_dim, min(itemsize, 4))
    if key not in _XLA_TABLE:
        key = min(_XLA_TABLE, key=lambda k: (abs(k[0] - head_dim), abs(k[1] - itemsize)))
    max_rows, kv_target = _XLA_TABLE[key]
    max_bq = max(8, _pow2_at_most(max(1, max_rows // group)))
    avg = -(-num_tokens // max(1, num_seq_slots))
    # A bucket with many sequence slots may still carry one long prefill chunk (the
    # engine's mixed steps): never let block_q fall below MIN_PREFILL_BLOCK_Q there, or
    # the chunk runs as many tiny matmuls. Pure decode batches take the batched path.
    floor = min(MIN_PREFILL_BLOCK_Q, num_tokens)
    bq = min(max_bq, max(8, _pow2_at_least(max(avg, floor))))
    bq = min(bq, max(8, _pow2_at_least(num_tokens)))
    return BlockSizes(block_q=bq, block_kv=kv_block(page_size, min(kv_target, max(MIN_BLOCK_KV, bq))))


# ---------------------------------------------------------------------------------------
# Pallas TPU (Mosaic). Keys: (head_dim, itemsize). block_q rows of one sequence times the
# G query heads of one KV head form the MXU operand; KV blocks are whole pages.
# Values follow the public ragged-paged-attention tuning tables for v5e/v6e-class chips:
# 128..256 queries and 256..512 keys per step for prefill.
_TPU_TABLE = {
    (64, 4): (128, 256),
    (128, 4): (128, 256),
    (256, 4): (64, 256),
    (64, 2): (128, 512),
    (128, 2): (128, 512),
    (256, 2): (128, 256),
}


def tpu_block_sizes(num_tokens: int, num_seq_slots: int, head_dim: int, itemsize: int,
                    page_size: int, max_pages: int) -> BlockSizes:
    key = (head_dim, min(itemsize, 4))
    bq, bk = _TPU_TABLE.get(key, (128, 256))
    avg = -(-num_tokens // max(1, num_seq_slots))
    bq = min(bq, max(8, _pow2_at_least(avg)))
    bk = min(kv_block(page_size, bk), max_pages * page_size)
    return BlockSizes(block_q=bq, block_kv=bk)


# ---------------------------------------------------------------------------------------
# Pallas GPU (Triton lowering). Keys: (head_dim, itemsize). Triton wants power-of-two
# tiles; [block_q * G, D] x [D, block_kv] tensor-core dots with f32 accumulators.
_GPU_TABLE = {
    (64, 4): (64, 64),
    (128, 4): (32, 64),
    (256, 4): (16, 32),
    (64, 2): (64, 64),
    (128, 2): (64, 64),
    (256, 2): (32, 32),
}


def gpu_block_sizes(num_tokens: int, num_seq_slots: int, group: int, head_dim: int,
                    itemsize: int, page_size: int) -> BlockSizes:
    key = (head_dim, min(itemsize, 4))
    bq, bk = _GPU_TABLE.get(key, (32, 32))
    # Keep the stacked operand [G*block_q, D] at most 128 rows (register file pressure).
    bq = max(1, min(bq, _pow2_at_most(max(1, 128 // group))))
    avg = -(-num_tokens // max(1, num_seq_slots))
    bq = min(bq, max(1, _pow2_at_least(avg)))
    bq = max(bq, 16 // group if group < 16 else 1)
    return BlockSizes(block_q=bq, block_kv=bk)
