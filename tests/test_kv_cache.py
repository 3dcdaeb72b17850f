"""write_kv puts each token exactly where its slot says, and nowhere else."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfill.pallas_kernels import init_kv_pages, split_kv, write_kv


def test_write_kv_places_tokens_and_leaves_the_rest():
    num_pages, page_size, hkv, d = 6, 4, 2, 8
    pages = init_kv_pages(num_pages, page_size, hkv, d, jnp.float32, fill_value=float("nan"))
    rng = np.random.default_rng(0)
    k = rng.standard_normal((7, hkv, d)).astype(np.float32)
    v = rng.standard_normal((7, hkv, d)).astype(np.float32)
    slots = np.array([3 * 4 + 1, 3 * 4 + 2, -1, 0 * 4 + 3, 5 * 4 + 0, -1, 1 * 4 + 3], np.int32)
    out = np.asarray(jax.jit(write_kv, donate_argnums=0)(pages, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots)))
    written = np.zeros((num_pages, page_size), bool)
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        page, off = divmod(int(slot), page_size)
        written[page, off] = True
        got_k, got_v = split_kv(out[page, off])
        np.testing.assert_array_equal(got_k, k[t])
        np.testing.assert_array_equal(got_v, v[t])
        np.testing.assert_array_equal(out[page, off, 0::2], k[t])  # K of head h at combined index 2h
    assert np.isnan(out[~written]).all()


def test_write_kv_rejects_mismatched_shapes():
    pages = init_kv_pages(2, 4, 2, 8)
    with pytest.raises(ValueError, match="write_kv"):
        write_kv(pages, jnp.ones((3, 1, 8)), jnp.ones((3, 1, 8)), jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(pages, jnp.ones((3, 2, 8)), jnp.ones((3, 2, 8)), jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match="positive"):
        init_kv_pages(0, 4, 2, 8)
