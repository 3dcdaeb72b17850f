"""The xla impl's polynomial exp2 against float64 2**x (it replaces jnp.exp2 in softmax)."""

from __future__ import annotations

import jax
import numpy as np

from jaxfill.pallas_kernels.ragged_paged_attention.online_softmax import exp2


def test_exp2_relative_error_and_flush():
    rng = np.random.default_rng(0)
    x = np.concatenate([np.linspace(-125, 0, 200_001), -rng.random(200_000) * 125,
                        np.arange(-125, 1) + 0.5, np.arange(-125, 1) - 1e-4]).astype(np.float32)
    got = np.asarray(jax.jit(exp2)(x), np.float64)
    want = 2.0 ** x.astype(np.float64)
    assert np.max(np.abs(got / want - 1)) <= 1e-7
    low = np.asarray(jax.jit(exp2)(np.asarray([-126.0, -200.0, -1e30], np.float32)))
    assert np.all(low == np.float32(2.0 ** -126))
