"""Both grouped matmuls (models/grouped_matmul.py) against a float64 NumPy oracle: empty
groups, groups crossing tile boundaries, one group holding every row, a group smaller
than a tile, NaN in the rows past the groups (they must come out exactly 0)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfill.models.grouped_matmul import grouped_matmul

CASES = {
    "mixed": (300, [0, 100, 7, 0, 150]),  # 43 padding rows
    "one-group": (256, [0, 0, 256, 0]),
    "tiny": (16, [5, 0, 9]),
    "all-empty": (32, [0, 0, 0]),
    "many-boundaries": (640, [33] * 16 + [0] * 4),
}


def oracle(x, w, sizes):
    out = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for g, size in enumerate(sizes):
        out[start:start + size] = x[start:start + size].astype(np.float64) @ w[g].astype(np.float64)
        start += size
    return out


@pytest.mark.parametrize("impl", ["tiled", "ragged_dot"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_the_float64_oracle(impl, name):
    m, sizes = CASES[name]
    rng = np.random.default_rng(len(name))
    x = rng.standard_normal((m, 24)).astype(np.float32)
    w = rng.standard_normal((len(sizes), 24, 40)).astype(np.float32)
    x[sum(sizes):] = np.nan
    fn = jax.jit(lambda a, b, c: grouped_matmul(a, b, c, impl, tile=64))
    got = np.asarray(fn(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes, jnp.int32)), np.float64)
    want = oracle(np.nan_to_num(x), w, sizes)
    np.testing.assert_array_equal(got[sum(sizes):], 0.0)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", ["mixed", "tiny", "all-empty"])
def test_pallas_tpu_kernel_in_the_interpreter(name):
    """The TPU kernel under the TPU interpreter (about 100x slower than XLA: small blocks,
    two K steps so the reduction is exercised)."""
    from jaxfill.pallas_kernels.grouped_matmul_tpu import grouped_matmul_tpu

    m, sizes = CASES[name]
    m = min(m, 48)
    sizes = [min(s, max(0, m - sum(sizes[:i]))) for i, s in enumerate(sizes)]
    rng = np.random.default_rng(7)
    x = rng.standard_normal((m, 32)).astype(np.float32)
    w = rng.standard_normal((len(sizes), 32, 16)).astype(np.float32)
    x[sum(sizes):] = np.nan
    got = np.asarray(grouped_matmul_tpu(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes, jnp.int32),
                                        tm=8, tk=16, tn=8), np.float64)
    np.testing.assert_array_equal(got[sum(sizes):], 0.0)
    np.testing.assert_allclose(got, oracle(np.nan_to_num(x), w, sizes), rtol=2e-5, atol=2e-5)


def test_bf16_rounds_once_like_ragged_dot():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((200, 32)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((3, 32, 16)), jnp.bfloat16)
    sizes = jnp.asarray([50, 70, 80], jnp.int32)
    tiled = grouped_matmul(x, w, sizes, "tiled", tile=64)
    assert tiled.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(tiled, np.float32),
                                  np.asarray(jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)
                                             .astype(jnp.bfloat16), np.float32))


def test_unknown_impl_is_refused():
    with pytest.raises(ValueError, match="tiled"):
        grouped_matmul(jnp.ones((4, 2)), jnp.ones((1, 2, 2)), jnp.asarray([4], jnp.int32), "megablox")
