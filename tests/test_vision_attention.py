"""models/vision/attention.py's blocked segment attention against a float64 numpy oracle:
several blocks, several segments (one spanning a block edge, one not contiguous), padding
rows (segment -1) and a row count that is not a multiple of the block."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxfill.models.vision.attention import segment_attention


def oracle(q, k, v, segments, scale):  # [N, H, D] x3, [N] -> [N, H, D] f64; a query seeing nothing: 0
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("qhd,khd->hqk", q, k) * scale
    see = (segments[:, None] == segments[None, :]) & (segments[None, :] >= 0)
    s = np.where(see[None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    l = p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p / np.where(l > 0, l, 1.0), v)


def _inputs(segments, h=3, d=16, seed=0):
    rng = np.random.default_rng(seed)
    n = len(segments)
    q, k, v = (rng.standard_normal((n, h, d)).astype(np.float32) * 2 for _ in range(3))
    return q, k, v, np.asarray(segments, np.int32)


@pytest.mark.parametrize("block", [16, 32, 512])
def test_blocked_equals_float64_oracle(block):
    # 0: rows 0..36 (over two block edges at 16); 1: 37..49; 2: 50..56 and again 70..74 (not contiguous);
    # padding -1 in between and at the end; 83 rows: not a multiple of the block
    segments = [0] * 37 + [1] * 13 + [2] * 7 + [-1] * 13 + [2] * 5 + [-1] * 8
    q, k, v, seg = _inputs(segments)
    out = np.asarray(segment_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(seg), 0.25,
                                       block=block))
    assert out.shape == q.shape and not np.isnan(out).any()
    ref = oracle(q, k, v, seg, 0.25)
    assert np.abs(out - ref).max() < 2e-5 * np.abs(ref).max()
    assert (out[seg < 0] == 0).all()  # padding queries see nothing


def test_padding_keys_never_leak():
    """NaN in every padding row's q, k, v stays there: valid rows are finite and unchanged."""
    segments = [0] * 20 + [1] * 30 + [-1] * 46
    q, k, v, seg = _inputs(segments, seed=1)
    ref = oracle(q, k, v, seg, 0.125)
    for x in (q, k, v):
        x[seg < 0] = np.nan
    out = np.asarray(segment_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(seg), 0.125,
                                       block=16))
    assert not np.isnan(out[seg >= 0]).any()
    assert np.abs(out[seg >= 0] - ref[seg >= 0]).max() < 2e-5 * np.abs(ref).max()


def test_patch_buckets_step_in_quarter_octaves():
    from jaxfill.engine.vision.tower import patch_bucket
    assert [patch_bucket(n) for n in (1, 64, 65, 784, 1024, 1025, 7056)] == [64, 64, 128, 896, 1024, 1280, 7168]
    sizes = [patch_bucket(n) for n in range(1, 16385)]
    assert all(s >= n and s % 64 == 0 and (s - n < 64 or s < 1.25 * n) for n, s in enumerate(sizes, 1))
    assert len(set(sizes)) == 28  # compiled encoders for images up to 16384 patches (power of two: 9)
