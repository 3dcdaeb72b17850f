"""The model's logits do not depend on which attention impl runs.

A prompt is prefilled in two chunks (the second has kv_len > q_len) into a cache whose
unused slots are NaN, with each impl; logits must match `reference` within 1e-5 rel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxfill import models
from jaxfill.models.kv_cache import single_sequence_metadata

PAGE_SIZE = 8
PAGES = [5, 2, 7, 0]  # out of order on purpose
BUCKET = 16


def run_chunks(impl, chunks):
    config = models.ModelConfig()
    model = models.Decoder(config, attention_impl=impl)
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, tokens, positions, cache, meta):
        return nnx.merge(graphdef, state)(tokens, positions, cache, meta)

    cache = models.KVCache.create(config, num_pages=9, page_size=PAGE_SIZE,
                                  fill_value=float("nan"))
    start, logits = 0, []
    for chunk in chunks:
        pad = BUCKET - len(chunk)  # one shape bucket: one compile per impl
        meta = single_sequence_metadata(len(chunk), start, PAGES, PAGE_SIZE, pad_to=BUCKET)
        tokens = jnp.asarray(list(chunk) + [0] * pad, jnp.int32)
        positions = jnp.asarray(list(range(start, start + len(chunk))) + [0] * pad, jnp.int32)
        out, cache = forward(state, tokens, positions, cache, meta)
        logits.append(np.asarray(out))
        start += len(chunk)
    return logits


@pytest.fixture(scope="module")
def prompt():
    rng = np.random.default_rng(0)
    return rng.integers(1, 300, size=21).tolist()


@pytest.fixture(scope="module")
def reference_logits(prompt):
    return run_chunks("reference", [prompt[:13], prompt[13:]])


@pytest.mark.parametrize("impl", ["xla", "pallas_tpu", "pallas_gpu"])
def test_logits_match_reference(impl, prompt, reference_logits):
    got = run_chunks(impl, [prompt[:13], prompt[13:]])
    for ref, out in zip(reference_logits, got):
        assert np.isfinite(out).all()
        err = np.max(np.abs(out - ref)) / np.max(np.abs(ref))
        assert err <= 1e-5, f"{impl}: logits rel err {err:.3g}"
