"""engine.scan_layers: the layers as one lax.scan over stacked params and a stacked cache.
Same tokens as the unrolled model through Engine.generate, and a program whose size does
not grow with depth (the reason to scan: compile time)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxfill.models.execution_plan import ExecutionPlan
from jaxfill.engine.batch import dummy_batch
from jaxfill.engine.config import load_config
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
from jaxfill.engine.step import StaticGraph, step
from jaxfill.models.config import ConfigError
from jaxfill.models.kv_cache import KVCache
from jaxfill.models.decoder import Decoder
from fast_engine import REFERENCE_ATTENTION

BASE = {**REFERENCE_ATTENTION,  # tests/fast_engine.py
        "engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64], "engine.num_pages": 48,
        "engine.max_model_len": 256}
SHARED = "A shared opening that fills whole pages of the cache, twice over. "
PROMPTS = [SHARED + "one", "xyz" * 30, SHARED + "two", "Hi"]
PARAMS = [SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, temperature=0.9, seed=3),
          SamplingParams(max_tokens=5, logprobs=2), SamplingParams(max_tokens=10, temperature=0.7, top_k=5, seed=9)]


def generate(overrides):
    engine = Engine.from_config("tiny_random", overrides={**BASE, **overrides}, progress=False)
    out = engine.generate(PROMPTS, PARAMS)
    again = engine.generate([SHARED + "three"], SamplingParams(max_tokens=6))
    stats = engine.stats()
    assert stats["pages_free"] == stats["pages_total"]
    return [c.token_ids for c in out + again], again[0].cached_tokens, engine


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{}, {"engine.kv_cache_dtype": "int8"}, {"engine.async_scheduling": False}],
                         ids=["auto", "int8_kv", "sync"])
def test_scanned_layers_give_the_unrolled_tokens(extra):
    want, want_cached, _ = generate(extra)
    got, got_cached, engine = generate({**extra, "engine.scan_layers": True})
    assert got == want and got_cached == want_cached > 0
    assert len({tuple(t) for t in want}) == 5
    cache = engine.runner.kv_cache
    assert cache.stages == 4 and len(cache.pages) == 1  # one entry [L, pages, ...]
    assert jax.tree.leaves(cache.pages)[0].shape[:2] == (4, BASE["engine.num_pages"])


def _lowered_dots(num_layers: int, scan: bool) -> int:
    """dot_general ops in the step's lowered program for a model of num_layers layers."""
    config = load_config("tiny_random", BASE)
    m = dataclasses.replace(config.model, num_layers=num_layers)
    stages = num_layers if scan else 1
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(m, nnx.Rngs(0), plan=ExecutionPlan.stacked(stages))))
    cache = jax.eval_shape(lambda: KVCache.create(m, 8, config.engine.page_size, stages=stages))
    batch = dummy_batch((16, 4), config.engine.max_pages_per_seq, config.engine.penalty_window, m.vocab_size)
    prev = jax.ShapeDtypeStruct((config.engine.max_num_seqs,), jnp.int32)
    return step.lower(StaticGraph(graphdef), state, cache, batch, prev).as_text().count("dot_general")


def test_the_scanned_program_does_not_grow_with_depth():
    unrolled = [_lowered_dots(n, scan=False) for n in (2, 8)]
    scanned = [_lowered_dots(n, scan=True) for n in (2, 8)]
    assert scanned[0] == scanned[1] > 0
    assert unrolled[1] > 3 * unrolled[0] / 2 and unrolled[1] > scanned[1]


def test_scan_layers_and_stages_exclude_each_other():
    with pytest.raises(ConfigError, match="choose one"):
        load_config("tiny_random", {"engine.scan_layers": True, "mesh.stage": 2})


def test_staged_cache_reports_one_layer_shape():
    config = load_config("tiny_random").model
    cache = KVCache.create(config, 6, 8, stages=4)
    plain = KVCache.create(config, 6, 8)
    assert (cache.num_pages, cache.page_size, cache.nbytes()) == (plain.num_pages, plain.page_size, plain.nbytes())
    assert np.asarray(cache.pages[0]).shape == (4, 6, 8, 2 * config.num_kv_heads, config.head_dim)


def _step_temp_bytes(stages: int, num_pages: int) -> tuple[int, int]:
    """(compiled temp bytes of the 16x4 step, cache bytes) for tiny_random, nothing allocated."""
    config = load_config("tiny_random", BASE)
    m = config.model
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(m, nnx.Rngs(0), plan=ExecutionPlan.stacked(stages))))
    cache = jax.eval_shape(lambda: KVCache.create(m, num_pages, config.engine.page_size, stages=stages))
    batch = dummy_batch((16, 4), config.engine.max_pages_per_seq, config.engine.penalty_window, m.vocab_size)
    prev = jax.ShapeDtypeStruct((config.engine.max_num_seqs,), jnp.int32)
    compiled = step.lower(StaticGraph(graphdef), state, cache, batch, prev).compile()
    return compiled.memory_analysis().temp_size_in_bytes, sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache))


@pytest.mark.slow  # 46 s in a full run (2026-12-07, 2 loaded cores)
def test_the_scan_updates_the_cache_in_place():
    # Taking a layer's pages out of the scan carry and writing them back would cost one
    # layer's pages of temp memory (and two copies of the cache per step in time).
    unrolled, cache_bytes = _step_temp_bytes(1, 1024)
    scanned, _ = _step_temp_bytes(4, 1024)
    assert scanned < unrolled + cache_bytes / 4 / 4, (scanned, unrolled, cache_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["auto", "int8"])
def test_a_checkpoint_loads_straight_into_the_scanned_layout(weights):
    """The trained tiny checkpoint through models.checkpoint.StackedSlices (no mesh)."""
    def tokens(scan):
        engine = Engine.from_config("tiny", overrides={**BASE, "engine.scan_layers": scan,
                                                       "model.weight_dtype": weights}, progress=False)
        return [c.token_ids for c in engine.generate(PROMPTS, PARAMS)], engine

    want, _ = tokens(False)
    got, engine = tokens(True)
    assert got == want and engine.runner.stages == 4
