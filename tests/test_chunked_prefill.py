"""A prompt gives the same logits and cache in one pass, in chunks, or token by token."""

import numpy as np
import pytest

from jaxfill.engine.simple import prefill_chunks
from jaxfill.models import KVCache, Decoder, ModelConfig

pytestmark = pytest.mark.xla_attention  # the CPU default impl end to end (tests/conftest.py)

CONFIG = ModelConfig(num_layers=2, max_position_embeddings=512)
PROMPT = list(np.random.default_rng(0).integers(0, CONFIG.vocab_size, 37))
PAGES = [5, 2, 9]  # deliberately out of order


@pytest.fixture(scope="module")
def model():
    return Decoder(CONFIG)


def run(model, chunk):
    cache = KVCache.create(CONFIG, num_pages=12, page_size=16, fill_value=float("nan"))
    logits, cache = prefill_chunks(model, PROMPT, cache, PAGES, chunk=chunk)
    return np.asarray(logits), cache


def test_chunked_equals_one_pass(model):
    whole, whole_cache = run(model, None)
    assert np.isfinite(whole).all()
    for chunk in (1, 5, 16):
        logits, cache = run(model, chunk)
        np.testing.assert_allclose(logits, whole, rtol=1e-5, atol=1e-5 * np.abs(whole).max())
        for a, b in zip(cache.pages, whole_cache.pages):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6, equal_nan=True)


def test_prefill_touches_only_its_pages(model):
    _, cache = run(model, 5)
    pages = np.asarray(cache.pages[0])
    untouched = [p for p in range(12) if p not in PAGES]
    assert np.isnan(pages[untouched]).all()
    assert np.isfinite(pages[5]).all() and np.isfinite(pages[2]).all()
    assert np.isfinite(pages[9, :37 - 32]).all() and np.isnan(pages[9, 37 - 32:]).all()
