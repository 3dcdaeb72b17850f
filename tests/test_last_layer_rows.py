"""The last layer runs only each sequence's sampled row (models/decoder.py): on a ragged
batch (a prompt continuing after cached tokens, a fresh prompt, a decode, padding rows and
a padding slot) its logits and every written KV page equal those of the full last layer,
and it costs measurably fewer FLOPs."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxfill.engine.config import load_config
from jaxfill.models.forward import forward
from jaxfill.models.kv_cache import AttentionMetadata, KVCache
from jaxfill.models.decoder import Decoder
from jaxfill.models.execution_plan import ExecutionPlan

PAGE = 16
SLOTS, MAX_PAGES = 4, 4


def batch(seqs, t_pad):
    """seqs: [(tokens of the whole sequence, start, num_new, pages)] -> tokens, positions, meta."""
    tokens = np.zeros(t_pad, np.int32)
    positions = np.zeros(t_pad, np.int32)
    slots = np.full(t_pad, -1, np.int32)
    cu = np.zeros(SLOTS + 1, np.int32)
    kv_lens = np.zeros(SLOTS, np.int32)
    page_indices = np.zeros((SLOTS, MAX_PAGES), np.int32)
    logits_idx = np.zeros(SLOTS, np.int32)
    t = 0
    for i, (ids, start, n, pages) in enumerate(seqs):
        pos = np.arange(start, start + n)
        tokens[t:t + n] = ids[start:start + n]
        positions[t:t + n] = pos
        slots[t:t + n] = np.asarray(pages)[pos // PAGE] * PAGE + pos % PAGE
        t += n
        cu[i + 1] = t
        kv_lens[i] = start + n
        page_indices[i, :len(pages)] = pages
        logits_idx[i] = t - 1
    cu[len(seqs) + 1:] = t
    meta = AttentionMetadata(cu_q_lens=jnp.asarray(cu), kv_lens=jnp.asarray(kv_lens),
                             page_indices=jnp.asarray(page_indices),
                             num_seqs=jnp.asarray([len(seqs)], jnp.int32),
                             slot_mapping=jnp.asarray(slots), logits_indices=jnp.asarray(logits_idx))
    return jnp.asarray(tokens), jnp.asarray(positions), meta


def two_steps(model, config):
    """Step 1 caches A[:20] and C[:9]; step 2 runs A[20:50], all of B (17), C's decode."""
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(0, config.vocab_size, n) for n in (50, 17, 10))
    pa, pb, pc = [1, 5, 9, 2], [3, 7], [4]
    graphdef, state = nnx.split(model)
    cache = KVCache.create(config, num_pages=12, page_size=PAGE, fill_value=float("nan"))
    step1 = batch([(a, 0, 20, pa), (c, 0, 9, pc)], t_pad=32)
    _, cache = forward(graphdef, state, step1[0], step1[1], cache, step1[2])
    step2 = batch([(a, 20, 30, pa), (b, 0, 17, pb), (c, 9, 1, pc)], t_pad=64)
    logits, cache = forward(graphdef, state, step2[0], step2[1], cache, step2[2])
    return np.asarray(logits)[:3], [np.asarray(p) for p in cache.pages], step2


def full_last_layer(model):
    """The same weights under a plan that runs every row of the last layer (the plan the
    engine builds when 'sequence' splits the rows)."""
    graphdef, state = nnx.split(model)
    full = nnx.merge(graphdef, state)
    full.plan = ExecutionPlan(prunes_last_layer=False)
    return full


@pytest.fixture(scope="module")
def model_and_config():
    config = load_config("tiny_random").model
    return Decoder(config), config


@pytest.mark.slow
def test_sampled_rows_match_the_full_last_layer(model_and_config):
    model, config = model_and_config
    logits, pages, _ = two_steps(model, config)
    ref_logits, ref_pages, _ = two_steps(full_last_layer(model), config)
    assert np.isfinite(logits).all()
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert len(pages) == config.num_layers
    for layer, (got, want) in enumerate(zip(pages, ref_pages)):
        written = ~np.isnan(want)
        assert written.sum() == (50 + 17 + 10) * got[0, 0].size, layer  # every token's K/V, last layer too
        np.testing.assert_array_equal(np.isnan(got), ~written)
        np.testing.assert_allclose(got[written], want[written], rtol=1e-6, atol=1e-6)


def test_last_layer_costs_fewer_flops(model_and_config):
    model, config = model_and_config
    cache = KVCache.create(config, num_pages=12, page_size=PAGE, fill_value=float("nan"))
    rng = np.random.default_rng(1)
    step = batch([(rng.integers(0, config.vocab_size, 64), 0, 64, [1, 2, 3, 4])], t_pad=64)

    def flops(model):
        graphdef, state = nnx.split(model)
        lowered = forward.lower(graphdef, state, step[0], step[1], cache, step[2])
        return lowered.compile().cost_analysis()["flops"]

    pruned = flops(model)
    full = flops(full_last_layer(model))
    # One of L layers keeps only its K/V projection over the 64 rows: the saving is most
    # of a layer's share (4 layers here).
    e, i, hq, hk, d = (config.hidden_size, config.intermediate_size, config.num_heads,
                       config.num_kv_heads, config.head_dim)
    layer_matmuls = 2 * 64 * e * (2 * hq * d + 2 * hk * d + 3 * i)
    kept = 2 * 64 * e * 2 * hk * d
    assert full - pruned >= 0.9 * (layer_matmuls - kept), (full, pruned)


@pytest.mark.slow
def test_every_row_logits_run_the_full_last_layer(model_and_config):
    """Asking for more logit rows than sequences (training / evaluation read every row)
    keeps the whole last layer: every row's logits equal the unpruned model's, and the
    last row's equal the pruned one-row forward's."""
    import dataclasses

    from jaxfill.models.kv_cache import single_sequence_metadata

    model, config = model_and_config
    n = 40
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, config.vocab_size, n), jnp.int32)
    positions = jnp.arange(n, dtype=jnp.int32)
    one_row = single_sequence_metadata(n, 0, [1, 2, 3], PAGE)
    every_row = dataclasses.replace(one_row, logits_indices=jnp.arange(n, dtype=jnp.int32))

    def logits(meta, model=model):
        graphdef, state = nnx.split(model)
        cache = KVCache.create(config, num_pages=4, page_size=PAGE, fill_value=float("nan"))
        return np.asarray(forward(graphdef, state, tokens, positions, cache, meta)[0])

    last, rows = logits(one_row), logits(every_row)
    ref_rows = logits(every_row, full_last_layer(model))
    assert rows.shape == (n, config.vocab_size) and np.isfinite(rows).all()
    np.testing.assert_allclose(rows, ref_rows, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rows[-1:], last, rtol=1e-5, atol=1e-5)
    assert np.abs(rows[0] - rows[-1]).max() > 1e-3  # rows differ: not one row broadcast
