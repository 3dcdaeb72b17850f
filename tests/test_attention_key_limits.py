"""Rows that see keys past their own position (Gemma 3's image rows, `key_limits`) against
the float64 oracle: a block of rows in the middle of a prefill sees the whole block, the
rest causal, with and without a sliding window; every impl name runs `reference` then."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from attention_oracle import make_batch, oracle

from jaxfill.pallas_kernels import ragged_paged_attention

SEQS = [(20, 26), (3, 9), (12, 12)]  # (q_len, kv_len): a prefill after 6 cached rows, a chunk, a prefill


def _limits(batch):
    """Seq 0's rows at positions 10..17 (an image) see up to 17; seq 2's rows 0..4 see up to 4."""
    limits = np.full(batch.q.shape[0], -1, np.int32)
    limits[10 - 6:17 - 6 + 1] = 17  # seq 0's first new row is position 6
    limits[23:28] = 4  # seq 2 starts at token row 23
    return limits


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_key_limits_equal_the_oracle(window, impl):
    batch = make_batch(SEQS, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4, num_tokens=40, num_slots=4,
                       max_pages=8)
    limits = _limits(batch)
    ref, live = oracle(*batch.args(), sm_scale=0.25, sliding_window=window, key_limits=limits)
    out = np.asarray(ragged_paged_attention(*[jnp.asarray(a) for a in batch.args()], sm_scale=0.25,
                                            sliding_window=window, impl=impl, key_limits=jnp.asarray(limits)))
    err = np.abs(out[live] - ref[live]).max() / np.abs(ref[live]).max()
    assert err < 1e-5, err
    causal, _ = oracle(*batch.args(), sm_scale=0.25, sliding_window=window)
    assert np.abs(causal[4:12] - ref[4:12]).max() > 1e-3  # the limits change those rows
