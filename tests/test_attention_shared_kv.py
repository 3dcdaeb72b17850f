"""Shared K/V pages (multi-head latent attention: V is K, so the pages hold K only, half
the bytes): write_kv(v=None) stores what the interleaved layout stores in its K slots,
and attention over them equals attention over pages whose V slot copies the K slot, with
unused slots NaN-filled."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxfill.pallas_kernels import QuantizedPages, write_kv
from jaxfill.pallas_kernels.kv_quant import init_quantized_pages
from jaxfill.pallas_kernels.ragged_paged_attention import ragged_paged_attention

PAGE, PAGES, D, HKV, HQ = 4, 12, 24, 1, 8


def batch(rng):
    """Two sequences: a 7-token prefill over 3 cached tokens, and a 1-token decode over 9."""
    cached, new = [3, 9], [7, 1]
    kv_lens = np.asarray([c + n for c, n in zip(cached, new)], np.int32)
    page_indices = np.asarray([[1, 2, 3, 0], [5, 6, 7, 0]], np.int32)
    slots = [p * PAGE + o for s, n in enumerate(kv_lens)
             for p, o in [(page_indices[s][i // PAGE], i % PAGE) for i in range(n)]]
    k = rng.standard_normal((len(slots), HKV, D)).astype(np.float32)
    q = rng.standard_normal((sum(new), HQ, D)).astype(np.float32)
    cu = np.asarray([0, new[0], sum(new)], np.int32)
    return q, k, np.asarray(slots, np.int32), kv_lens, page_indices, cu


IMPLS = ["reference", "xla", "pallas_gpu", "pallas_tpu"]  # the Pallas ones interpreted on CPU


@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "int8"])
@pytest.mark.parametrize("impl", IMPLS)
def test_shared_pages_equal_pages_with_a_v_copy(impl, quantized):
    rng = np.random.default_rng(0)
    q, k, slots, kv_lens, page_indices, cu = batch(rng)
    if quantized:
        copied = init_quantized_pages(PAGES, PAGE, HKV, D, "int8")
        shared = QuantizedPages(copied.values[:, :, :HKV], copied.scales[:, :, :HKV])
    else:
        nan = float("nan")
        copied, shared = jnp.full((PAGES, PAGE, 2 * HKV, D), nan), jnp.full((PAGES, PAGE, HKV, D), nan)
    copied = write_kv(copied, jnp.asarray(k), jnp.asarray(k), jnp.asarray(slots))
    shared = write_kv(shared, jnp.asarray(k), None, jnp.asarray(slots))
    args = (jnp.asarray(page_indices), jnp.asarray(cu), jnp.asarray([2], np.int32))
    qs = jnp.asarray(q)
    want = ragged_paged_attention(qs, copied, jnp.asarray(kv_lens), *args, sm_scale=D ** -0.5, impl=impl)
    got = ragged_paged_attention(qs, shared, jnp.asarray(kv_lens), *args, sm_scale=D ** -0.5, impl=impl,
                                 kv_shared=True)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_shared_pages_hold_the_k_half():
    rng = np.random.default_rng(1)
    q, k, slots, *_ = batch(rng)
    copied = init_quantized_pages(PAGES, PAGE, HKV, D, "int8")
    shared = QuantizedPages(copied.values[:, :, :HKV], copied.scales[:, :, :HKV])
    copied = write_kv(copied, jnp.asarray(k), jnp.asarray(k), jnp.asarray(slots))
    shared = write_kv(shared, jnp.asarray(k), None, jnp.asarray(slots))
    np.testing.assert_array_equal(np.asarray(shared.values), np.asarray(copied.values)[:, :, 0::2])
    np.testing.assert_array_equal(np.asarray(shared.scales), np.asarray(copied.scales)[:, :, 0::2])
    nan = float("nan")
    copied = write_kv(jnp.full((PAGES, PAGE, 2 * HKV, D), nan), jnp.asarray(k), jnp.asarray(k), jnp.asarray(slots))
    shared = write_kv(jnp.full((PAGES, PAGE, HKV, D), nan), jnp.asarray(k), None, jnp.asarray(slots))
    np.testing.assert_array_equal(np.asarray(shared), np.asarray(copied)[:, :, 0::2])


def test_a_v_with_shared_pages_is_refused():
    k = jnp.ones((2, HKV, D))
    with pytest.raises(ValueError, match="write_kv"):
        write_kv(jnp.zeros((PAGES, PAGE, HKV, D)), k, k, jnp.asarray([1, 2], np.int32))
