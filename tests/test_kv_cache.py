"""write_kv puts each token exactly where its slot says, and nowhere else."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfill.pallas_kernels import init_kv_pages, split_kv, write_kv
from jaxfill.pallas_kernels.kv_cache import scatter_indices


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


def test_scatter_indices_are_distinct_with_padding_past_the_end():
    """write_kv declares unique_indices=True: many padding tokens (slot < 0) must not
    share one index; each goes past the end (dropped by mode="drop")."""
    total = 6 * 4
    slots = np.array([-1, 5, -1, -1, 23, -7, 0, -1], np.int32)
    idx = np.asarray(scatter_indices(jnp.asarray(slots), total))
    assert len(set(idx.tolist())) == len(idx)
    pad = slots < 0
    assert (idx[pad] >= total).all()
    np.testing.assert_array_equal(idx[~pad], slots[~pad])


def test_write_kv_scatter_is_declared_unique_and_drops_out_of_range():
    """The flag is what makes duplicate indices undefined: pin that it is the scatter's
    mode (drop, unique) our index scheme is written for."""
    pages = init_kv_pages(2, 4, 1, 8)
    jaxpr = jax.make_jaxpr(write_kv)(pages, jnp.ones((3, 1, 8)), jnp.ones((3, 1, 8)), jnp.zeros(3, jnp.int32))
    scatters = [e for e in jaxpr.eqns if e.primitive.name == "scatter"]
    assert len(scatters) == 1
    assert scatters[0].params["unique_indices"] is True
    assert "FILL_OR_DROP" in str(scatters[0].params["mode"])


def test_padding_tokens_with_garbage_never_touch_real_pages():
    """A NaN pool; most tokens are padding (slot -1 and other negatives) carrying huge
    and non-finite K/V; only the real tokens' slots change, to exactly their K/V."""
    num_pages, page_size, hkv, d, t = 5, 4, 2, 8, 16
    pages = init_kv_pages(num_pages, page_size, hkv, d, jnp.float32, fill_value=float("nan"))
    rng = np.random.default_rng(1)
    k = rng.standard_normal((t, hkv, d)).astype(np.float32)
    v = rng.standard_normal((t, hkv, d)).astype(np.float32)
    slots = np.full(t, -1, np.int32)
    real = {2: 7, 9: 4 * 4 + 3, 10: 0}
    for i, slot in real.items():
        slots[i] = slot
    slots[13] = -3
    pad = slots < 0
    k[pad], v[pad] = 1e30, np.inf
    out = np.asarray(jax.jit(write_kv, donate_argnums=0)(pages, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots)))
    flat = out.reshape(num_pages * page_size, 2 * hkv, d)
    for i, slot in real.items():
        np.testing.assert_array_equal(flat[slot, 0::2], k[i])
        np.testing.assert_array_equal(flat[slot, 1::2], v[i])
    untouched = np.ones(len(flat), bool)
    untouched[list(real.values())] = False
    assert np.isnan(flat[untouched]).all()
