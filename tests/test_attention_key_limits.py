"""Rows that see keys past their own position (Gemma 3's image rows, `key_limits`) against
the float64 oracle: blocks of rows in the middle of prefills see their whole block, the
rest causal (a decode beside them), with and without a sliding window; `reference`, and
`xla` at its default blocks and at small ones where a block's rows reach past the
diagonal into later KV blocks (the item path extends its KV loop to them)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from attention_oracle import make_batch, oracle

from jaxfill.pallas_kernels import ragged_paged_attention
from jaxfill.pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla

# (q_len, kv_len): a prefill after 6 cached rows, a chunk, a decode, a prefill
SEQS = [(20, 26), (3, 9), (1, 7), (12, 12)]


def _limits(batch):
    """Seq 0's rows at positions 10..17 see up to 17; seq 3's rows 0..4 see up to 4."""
    limits = np.full(batch.q.shape[0], -1, np.int32)
    limits[10 - 6:17 - 6 + 1] = 17  # seq 0's first new row is position 6
    limits[24:29] = 4  # seq 3 starts at token row 24
    return limits


def _batch():
    return make_batch(SEQS, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4, num_tokens=40, num_slots=5,
                      max_pages=8)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("impl", ["reference", "xla", "xla-8-8-2", "xla-8-16-1"])
def test_key_limits_equal_the_oracle(window, impl):
    batch = _batch()
    limits = _limits(batch)
    ref, live = oracle(*batch.args(), sm_scale=0.25, sliding_window=window, key_limits=limits)
    args = [jnp.asarray(a) for a in batch.args()]
    if impl.count("-"):  # block_q, block_kv, diag_splits
        bq, bk, splits = (int(x) for x in impl.split("-")[1:])
        out = ragged_paged_attention_xla(*args, sm_scale=0.25, sliding_window=window, block_q=bq, block_kv=bk,
                                         diag_splits=splits, key_limits=jnp.asarray(limits))
    else:
        out = ragged_paged_attention(*args, sm_scale=0.25, sliding_window=window, impl=impl,
                                     key_limits=jnp.asarray(limits))
    out = np.asarray(out)
    err = np.abs(out[live] - ref[live]).max() / np.abs(ref[live]).max()
    assert err < 1e-5, err
    causal, _ = oracle(*batch.args(), sm_scale=0.25, sliding_window=window)
    assert np.abs(causal[4:12] - ref[4:12]).max() > 1e-3  # the limits change those rows
