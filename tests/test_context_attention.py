"""One rank's share of context-parallel attention, merged by log-sum-exp, against the
float64 oracle.

A batch's pages are dealt round-robin to N simulated ranks (logical page j of every
sequence to rank j mod N), each rank's pool holding only its pages with NaN everywhere
else. Each rank runs the kernel on its pool (`kv_stride=N, kv_offset=r, return_lse`);
NumPy merges the partial outputs by their LSEs. The merge must equal attention over the
whole pool: causal bounds, kv_len, the sliding window's edge and rows with no local key
(LSE -inf) are all exercised, for odd and even N. No mesh here: tests/test_context_mesh.py
runs the same thing with collectives.
"""

from __future__ import annotations

import functools

import numpy as np
import jax.numpy as jnp
import pytest

from attention_oracle import make_batch, oracle, rel_err
from jaxfill.pallas_kernels import ragged_paged_attention
from jaxfill.pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla

# (q_len, kv_len) per sequence: a decode deep in its context, a chunk after a cached
# prefix, a fresh prompt, a single page, and a chunk ending mid-page.
SEQS = [(1, 61), (9, 40), (23, 23), (3, 3), (6, 37)]


def deal(batch, n: int):
    """Per rank: (pool NaN but for its pages, local page table)."""
    pages, table = batch.kv_pages, batch.page_indices
    ps = pages.shape[1]
    width = -(-table.shape[1] // n)
    out = []
    for r in range(n):
        mine = [(s, i, table[s, j]) for s in range(int(batch.num_seqs[0]))
                for i, j in enumerate(range(r, -(-int(batch.kv_lens[s]) // ps), n))]
        pool = np.full((len(mine) + 2,) + pages.shape[1:], np.nan, pages.dtype)
        local = np.full((table.shape[0], width), len(mine) + 1, np.int32)  # unused: a NaN page
        for free, (s, i, page) in enumerate(mine):
            pool[free] = pages[page]
            local[s, i] = free
        out.append((pool, local))
    return out


def merge(parts):
    """Exact LSE merge of [(out [T, Hq, D], lse [T, Hq])] in float64."""
    lse = np.stack([np.asarray(e, np.float64) for _, e in parts])  # [N, T, Hq]
    outs = np.stack([np.asarray(o, np.float64) for o, _ in parts])
    m = lse.max(axis=0)
    w = np.where(np.isfinite(lse), np.exp(lse - np.where(np.isfinite(m), m, 0)), 0.0)
    return (w[..., None] * outs).sum(0) / np.maximum(w.sum(0), 1e-300)[..., None]


def kernel(impl):
    """`xla_small`: the XLA kernel with one-page KV blocks, so every block bound counts."""
    if impl == "xla_small":
        return functools.partial(ragged_paged_attention_xla, block_q=8, block_kv=4, diag_splits=1)
    return functools.partial(ragged_paged_attention, impl=impl)


@pytest.mark.parametrize("impl", ["xla", "xla_small", "reference"])
@pytest.mark.parametrize("n,window,cap", [(2, None, None), (3, 11, None), (4, None, 30.0)])
def test_rank_shares_merge_to_the_oracle(impl, n, window, cap):
    batch = make_batch(SEQS, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=4,
                       num_tokens=48, num_slots=6, max_pages=16, seed=n)
    kw = dict(sm_scale=32 ** -0.5, sliding_window=window, soft_cap=cap)
    ref, live = oracle(*batch.args(), **kw)
    parts = []
    for r, (pool, table) in enumerate(deal(batch, n)):
        out, lse = kernel(impl)(
            jnp.asarray(batch.q), jnp.asarray(pool), jnp.asarray(batch.kv_lens), jnp.asarray(table),
            jnp.asarray(batch.cu_q_lens), jnp.asarray(batch.num_seqs),
            kv_stride=n, kv_offset=jnp.int32(r), return_lse=True, **kw)
        parts.append((np.asarray(out)[live], np.asarray(lse)[live]))
        assert out.dtype == jnp.float32 and lse.shape == batch.q.shape[:2]
    got = merge(parts)
    assert np.isfinite(got).all()
    assert rel_err(got, ref[live], np.ones(live.sum(), bool)) < 1e-5
    # The decode row at position 60 (page 15) has keys on every rank; the fresh 3-token
    # prompt has none on ranks >= 1: its LSE there is -inf and it adds nothing.
    if n > 1:
        row = sum(q for q, _ in SEQS[:3])  # first row of the (3, 3) prompt
        assert np.isneginf(np.asarray(parts[1][1])[row]).all()


def test_one_rank_is_the_plain_kernel():
    """kv_stride=1 with return_lse gives the plain output and the row's LSE."""
    batch = make_batch(SEQS, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=4,
                       num_tokens=48, num_slots=6, max_pages=16, seed=7)
    args = [jnp.asarray(a) for a in batch.args()]
    plain = ragged_paged_attention(*args, sm_scale=0.2, impl="xla")
    out, lse = ragged_paged_attention(*args, sm_scale=0.2, impl="xla", return_lse=True)
    _, live = oracle(*batch.args(), sm_scale=0.2)
    np.testing.assert_allclose(np.asarray(out)[live], np.asarray(plain)[live], rtol=1e-6, atol=1e-6)
    ref = ragged_paged_attention(*args, sm_scale=0.2, impl="reference", return_lse=True)[1]
    assert np.isfinite(np.asarray(lse)[live]).all()
    np.testing.assert_allclose(np.asarray(lse)[live], np.asarray(ref)[live], rtol=1e-5, atol=1e-5)


def test_pallas_impls_refuse_a_share():
    batch = make_batch([(2, 5)], num_q_heads=2, num_kv_heads=1, head_dim=32, page_size=4)
    with pytest.raises(ValueError, match="context-parallel"):
        ragged_paged_attention(*[jnp.asarray(a) for a in batch.args()], sm_scale=0.2,
                               impl="pallas_tpu", kv_stride=2, kv_offset=jnp.int32(0), return_lse=True)
