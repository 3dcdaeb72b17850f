"""The xla impl's split causal diagonal (`diag_splits`: row chunks with their own key
windows, xla_items.attend_items) against the float64 oracle, on shapes where the split matters:
q lengths off the block, chunks starting mid-page and mid-block (windows overrun the
last block), several sequences in one block, padding, sliding window, soft cap, NaN in
every unowned page slot (make_batch)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from attention_oracle import make_batch, oracle, rel_err
from jaxfill.pallas_kernels.ragged_paged_attention.block_sizes import xla_diagonal_splits
from jaxfill.pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla

BQ = BK = 32
PAGE = 8
# name -> (seqs as (q_len, kv_len), num_tokens, num_slots, sliding_window, soft_cap)
CASES = {
    "aligned_prefill": ([(128, 128)], 128, 1, None, None),
    "q_len_off_block": ([(100, 100)], 104, 2, None, None),
    "chunk_mid_page": ([(77, 90)], 80, 1, None, None),  # first new token at position 13
    "chunk_mid_block": ([(70, 118)], 72, 1, None, None),  # ... at 48: 2 diagonal blocks
    "seqs_share_blocks": ([(5, 9), (37, 50), (0, 0), (20, 61), (1, 30), (9, 9)], 80, 8,
                          None, None),
    "window_and_cap": ([(61, 83), (40, 40)], 104, 3, 21, 30.0),
}


@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_diagonal_split_matches_oracle(case, splits):
    seqs, tokens, slots, window, cap = CASES[case]
    batch = make_batch(seqs, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=PAGE,
                       num_tokens=tokens, num_slots=slots, seed=len(seqs) + tokens)
    ref, live = oracle(*batch.args(), sm_scale=0.125, sliding_window=window, soft_cap=cap)
    out = ragged_paged_attention_xla(*map(jnp.asarray, batch.args()), sm_scale=0.125,
                                     sliding_window=window, soft_cap=cap, block_q=BQ,
                                     block_kv=BK, diag_splits=splits)
    out = np.asarray(out, np.float64)
    assert np.isfinite(out[live]).all(), "NaN reached a live row"
    assert rel_err(out, ref, live) <= 1e-5


@pytest.mark.parametrize("splits", [2, 4])
def test_chunks_skip_keys_above_their_diagonal(splits):
    """Keys at positions >= 64 are NaN (yet inside kv_len); the first new token sits at
    position 8, so diagonal windows overrun block edges. A row chunk whose last row is
    below position 64 must stay finite and exact: its windows zero keys past that row."""
    ctx, n = 8, 120
    batch = make_batch([(n, n + ctx)], num_q_heads=4, num_kv_heads=2, head_dim=64,
                       page_size=PAGE, seed=3)
    ref, _ = oracle(*batch.args(), sm_scale=0.125)
    batch.kv_pages[batch.page_indices[0, 64 // PAGE:]] = np.nan
    out = ragged_paged_attention_xla(*map(jnp.asarray, batch.args()), sm_scale=0.125,
                                     block_q=BQ, block_kv=BK, diag_splits=splits)
    chunk = BQ // splits
    tok = np.arange(n)
    chunk_last_pos = (tok // chunk + 1) * chunk - 1 + ctx
    rows = tok[chunk_last_pos < 64]
    assert len(rows) > BQ  # more than the unsplit kernel could keep finite
    out = np.asarray(out, np.float64)
    assert np.isfinite(out[rows]).all()
    live = np.zeros(n, bool)
    live[rows] = True
    assert rel_err(out, ref, live) <= 1e-5


def test_split_rule():
    assert xla_diagonal_splits(256, 256, 16, 4) == 4  # the f32 prefill default
    assert xla_diagonal_splits(256, 256, 16, 2) == 1  # bf16: P rounding per KV block
    assert xla_diagonal_splits(128, 256, 16, 4) == 1  # not one triangle
    assert xla_diagonal_splits(128, 128, 16, 4) == 2  # chunks keep >= 64 rows
    assert xla_diagonal_splits(256, 256, 128, 4) == 2  # windows of whole pages
