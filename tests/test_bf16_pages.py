"""bf16 KV pages on XLA:CPU are stored as uint16 words (pallas_kernels/kv_cache.py): the
same values and tokens as bf16 storage, and a step whose temporaries do not grow with the
pool (bf16 storage made XLA:CPU convert the whole pool to f32 in every layer's KV write
and attention loop)."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfill import Engine, SamplingParams
from jaxfill.engine.config import load_config
from jaxfill.models import kv_cache
from jaxfill.models.kv_cache import KVCache
from jaxfill.pallas_kernels.kv_cache import WORDS, page_values, write_kv

_JAX_VERSION = tuple(int(part) for part in jax.__version__.split(".")[:2])
OVERRIDES = ["model.dtype=bfloat16", "engine.max_num_batched_tokens=32", "engine.token_buckets=[32]",
             "engine.max_num_seqs=4", "engine.max_model_len=256"]


def test_pages_are_words_and_a_write_stores_the_bf16_bits():
    config = load_config("tiny_random", OVERRIDES).model
    cache = KVCache.create(config, num_pages=8, page_size=4, fill_value=float("nan"))
    pages = cache.pages[0]
    assert pages.dtype == WORDS
    assert np.isnan(np.asarray(page_values(pages), np.float32)).all()
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.standard_normal((5, pages.shape[2] // 2, pages.shape[3])), jnp.float32) for _ in "kv")
    slots = jnp.asarray([3, 4, 9, -1, 30], jnp.int32)
    plain = write_kv(jnp.full(pages.shape, jnp.nan, jnp.bfloat16), k, v, slots)
    words = write_kv(pages, k, v, slots)
    assert words.dtype == WORDS
    np.testing.assert_array_equal(np.asarray(page_values(words), np.float32), np.asarray(plain, np.float32))


@contextlib.contextmanager
def bf16_storage():
    """KVCache.create as it was before: bf16 pages on CPU too."""
    words = kv_cache.page_storage_dtype
    kv_cache.page_storage_dtype = jnp.dtype
    try:
        yield
    finally:
        kv_cache.page_storage_dtype = words


def _step_temp_bytes(engine, num_pages: int) -> tuple[int, int]:
    runner = engine.core.runner
    with bf16_storage() if runner.kv_cache.pages[0].dtype == jnp.bfloat16 else contextlib.nullcontext():
        cache = KVCache.create(engine.config.model, num_pages, runner.page_size, fill_value=float("nan"))
    batch = runner.put(runner.dummy(runner.shapes[0]))
    compiled = runner.step_fn.lower(runner.static_graph, runner.state, cache, batch, runner.prev_tokens).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes), sum(a.nbytes for a in cache.arrays())


@pytest.fixture(scope="module")
def engines():
    words = Engine(load_config("tiny_random", OVERRIDES), progress=False)
    with bf16_storage():
        plain = Engine(load_config("tiny_random", OVERRIDES), progress=False)
    yield words, plain
    words.close()
    plain.close()


@pytest.mark.slow  # 37 s in a full run (2026-12-07, 2 loaded cores)
def test_step_temporaries_do_not_grow_with_the_pool(engines):
    words, _ = engines
    (small, small_pool), (big, big_pool) = (_step_temp_bytes(words, n) for n in (64, 2048))
    assert big - small < 0.05 * (big_pool - small_pool), (small, big, big_pool)


def test_a_bf16_write_copies_the_pool_on_cpu_and_a_words_write_does_not():
    """What the words storage removes: XLA:CPU's f32 round trip of the whole pool."""
    def temps(pages):
        k = jnp.ones((4, 2, 16), jnp.bfloat16)
        fn = jax.jit(write_kv, donate_argnums=0)
        compiled = fn.lower(pages, k, k, jnp.arange(4, dtype=jnp.int32)).compile()
        return int(compiled.memory_analysis().temp_size_in_bytes)
    shape = (512, 16, 4, 16)
    pool = int(np.prod(shape)) * 2
    assert temps(jnp.zeros(shape, WORDS)) < 0.01 * pool
    if _JAX_VERSION < (0, 11):  # jax 0.11.2 and 0.12 scatter bf16 natively (measured); 0.10.2 widens the pool
        assert temps(jnp.zeros(shape, jnp.bfloat16)) > pool


def test_words_and_bf16_pages_give_the_same_tokens(engines):
    words, plain = engines
    assert words.core.runner.kv_cache.pages[0].dtype == WORDS
    assert plain.core.runner.kv_cache.pages[0].dtype == jnp.bfloat16
    prompts = [[(i * 37 + j * 11) % 256 for j in range(n)] for i, n in enumerate([5, 70, 33])]  # 70: three chunks
    params = SamplingParams(max_tokens=10, temperature=0.0)
    a, b = words.generate(prompts, params), plain.generate(prompts, params)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert len({t for r in a for t in r.token_ids}) > 3
