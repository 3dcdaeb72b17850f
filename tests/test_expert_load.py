"""Per-expert token counts: the host totals of the device counters (wrap-around, replicas,
stacked stages, a fresh cache), the Prometheus histogram built from them, and an Engine
whose stats report them (padding of warm-up and bucket fill never counted)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxfill.engine.expert_load import LOAD_RATIO_BUCKETS, ExpertLoad, summary
from jaxfill.serving.metrics import ServerMetrics


@dataclasses.dataclass
class FakeCache:
    expert_tokens: tuple


def _int32(values):  # the device counter's wrapped int32 value of exact counts
    return jnp.asarray(np.asarray(values, np.int64).astype(np.uint32).view(np.int32))


def test_totals_survive_int32_wrap_and_a_fresh_cache():
    load = ExpertLoad(num_layers=2, num_experts=3, stages=1, interval_steps=1)
    start = np.array([2**31 - 10, 5, 0])
    load.snapshot(FakeCache((_int32(start), None)))
    assert load.totals(wait=True)[0].tolist() == start.tolist()
    later = start + np.array([100, 2**32 - 6, 7])  # past int32 and, for expert 1, almost a whole uint32 turn
    load.snapshot(FakeCache((_int32(later), None)))
    assert load.totals(wait=True)[0].tolist() == later.tolist()
    load.reset()  # a fresh cache counts from 0 again; the totals go on
    load.snapshot(FakeCache((_int32([1, 2, 3]), None)))
    assert load.totals(wait=True)[0].tolist() == (later + [1, 2, 3]).tolist()


def test_stacked_stages_and_replicas_map_to_layers():
    """Entry j of a cache stacked over p stages holds layer s*K + j in row s; its counter
    is [p, R*E] with the R data replicas side by side, summed on the host."""
    e, r, p = 4, 2, 2
    rng = np.random.default_rng(0)
    entries = [rng.integers(0, 100, (p, r * e)) for _ in range(2)]  # K = 2 entries, 4 layers
    load = ExpertLoad(num_layers=4, num_experts=e, stages=p, interval_steps=1)
    load.snapshot(FakeCache(tuple(jnp.asarray(a, jnp.int32) for a in entries)))
    got = load.totals(wait=True)
    for j, a in enumerate(entries):
        for s in range(p):
            assert got[s * 2 + j].tolist() == a[s].reshape(r, e).sum(0).tolist()


def test_snapshots_are_taken_every_interval_steps_and_never_block():
    load = ExpertLoad(num_layers=1, num_experts=2, stages=1, interval_steps=3)
    for step in range(1, 7):
        load.snapshot(FakeCache((jnp.asarray([step, 2 * step], jnp.int32),)))
    assert load.totals(wait=True)[0].tolist() == [6, 12]  # the copy of step 6
    load.snapshot(FakeCache((jnp.asarray([7, 14], jnp.int32),)))  # step 7: none due
    assert load.totals(wait=True)[0].tolist() == [6, 12]


def test_summary_is_rebuilt_only_when_a_copy_arrives():
    """stats() runs after every step: the summary is the same object until new counts fold."""
    load = ExpertLoad(num_layers=1, num_experts=2, stages=1, interval_steps=2)
    load.snapshot(FakeCache((jnp.asarray([1, 2], jnp.int32),)))  # step 1: none due
    first = load.summary()
    assert first["moe_expert_tokens"] == {} and load.summary() is first
    load.snapshot(FakeCache((jnp.asarray([3, 4], jnp.int32),)))  # step 2: a copy
    load.totals(wait=True)
    second = load.summary()
    assert second is not first and second["moe_expert_tokens"] == {0: [3, 4]} and load.summary() is second


def test_summary_reports_the_worst_layer():
    s = summary({0: np.array([10, 10, 10, 10]), 3: np.array([40, 0, 0, 0])})
    assert s["moe_load_imbalance"] == 4.0 and s["moe_expert_tokens"][3] == [40, 0, 0, 0]


def test_prometheus_histogram_of_load_ratios():
    metrics = ServerMetrics(model_name="m")
    metrics.update_stats({"moe_expert_tokens": {0: [0, 0, 0, 0]}})  # baseline
    metrics.update_stats({"moe_expert_tokens": {0: [10, 10, 10, 10], 1: [30, 5, 5, 0]}})
    same = {0: [10, 10, 10, 10], 1: [30, 5, 5, 0]}
    metrics.update_stats({"moe_expert_tokens": same})  # no change
    metrics.update_stats({"moe_expert_tokens": same})  # the same object: skipped
    fams = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    samples = {(s.name, s.labels.get("le")): s.value for s in fams["jaxfill_moe_expert_load_ratio"].samples}
    # layer 0 grew by 10 each (ratio 1); layer 1 appeared (from 0): ratios 3, 0.5, 0.5, 0
    ratios = np.array([1, 1, 1, 1, 3, 0.5, 0.5, 0])
    for le in LOAD_RATIO_BUCKETS:
        assert samples[("jaxfill_moe_expert_load_ratio_bucket", repr(float(le)))] == (ratios <= le).sum(), le
    assert samples[("jaxfill_moe_expert_load_ratio_count", None)] == 8
    assert samples[("jaxfill_moe_expert_load_ratio_sum", None)] == ratios.sum()


@pytest.mark.slow
def test_engine_stats_count_every_token_row_once():
    from jaxfill.engine.engine import Engine
    from jaxfill.engine.request import SamplingParams

    moe = {"model.num_experts": 8, "model.experts_per_token": 2, "model.moe_intermediate_size": 64,
           "engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64], "engine.num_pages": 64,
           "engine.enable_prefix_caching": False}
    engine = Engine.from_config("tiny_random", overrides=moe, progress=False)
    warm = engine.expert_tokens(refresh=True)  # warm-up ran all-padding batches: nothing counted
    assert len(warm) == engine.config.model.num_layers and all(c.sum() == 0 for c in warm.values())
    prompts = [list(range(3, 40)), list(range(50, 150))]  # 100 tokens: two chunks of <= 64
    done = engine.generate(prompts, SamplingParams(max_tokens=12))
    rows = sum(len(p) + len(c.token_ids) - 1 for p, c in zip(prompts, done))
    totals = engine.expert_tokens(refresh=True)
    last = engine.config.model.num_layers - 1
    assert sorted(totals) == list(range(last + 1))
    for layer, counts in totals.items():
        if layer != last:  # the last layer runs the sampled rows only
            assert counts.sum() == 2 * rows, layer
    stats = engine.stats()
    assert stats["moe_expert_tokens"] == {k: v.tolist() for k, v in totals.items()}
    assert stats["moe_load_imbalance"] >= 1.0
