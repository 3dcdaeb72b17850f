"""The prefix cache's host tier: evicted pages come back bit for bit, tokens never change.

Engines run tiny_random with a 16-page pool (about three of the workload's six
documents fit) and NaN-filled fresh pages, so a restore that missed a page, or wrote it
wrong, poisons the logits instead of passing unseen.
"""

import numpy as np
import pytest

import kv_tier_workload as wl
from jaxfill import Engine, SamplingParams
from jaxfill.engine.block_manager import prefix_hashes
from jaxfill.engine.kv_tier.host import HostKVTier, KVBlock
from jaxfill.engine.kv_tier.page_offload import gather_blocks
from jaxfill.models.config import ConfigError
from xla_flags import fake_devices

TIER = {"engine.host_kv_cache_gb": 0.001}  # ~1 MB: every block of the workload fits


def engine(**overrides) -> Engine:
    return Engine.from_config("tiny_random", overrides={**wl.BASE, **overrides}, progress=False)


@pytest.fixture(scope="module")
def plain():
    """The workload with the device prefix cache alone."""
    return wl.run(engine())


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)  # NaN-safe, dtype-blind equality


@pytest.mark.slow
def test_host_tier_serves_evicted_prefixes_with_the_same_tokens(plain):
    e = engine(**TIER)
    programs = e.stats()["compiled_programs"]
    tiered = wl.run(e)
    assert tiered["tokens"] == plain["tokens"]
    st = tiered["stats"]
    assert st["compiled_programs"] == programs  # warm-up compiled every save and restore size
    assert st["host_kv_hit_tokens"] > 0
    assert st["host_kv_pages_restored"] == st["host_kv_hits"]
    assert sum(tiered["cached"]) == sum(plain["cached"]) + st["host_kv_hit_tokens"]
    assert st["host_kv_cache_bytes"] <= st["host_kv_cache_budget_bytes"]
    assert st["pages_free"] == st["pages_total"]  # every page came back
    salted = [c for c, s in zip(tiered["cached"], tiered["salted"]) if s]
    assert salted == [0]  # the unsalted copies of its document, on device and host, are not its


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_restore_after_eviction_is_bit_exact(kv_dtype):
    e = engine(**TIER, **{"engine.kv_cache_dtype": kv_dtype})
    prompt = list(range(3, 36))  # 33 tokens: 4 full pages are cached
    e.generate([prompt], SamplingParams(max_tokens=1))
    bm, tier = e.scheduler.replicas[0].bm, e.runner.kv_offload.tier
    hashes = prefix_hashes(prompt, 8)
    pages = [bm.cached[h] for h in hashes]
    before_v, before_s = gather_blocks(e.runner.kv_cache.pages, np.asarray(pages, np.int32), num_kv_heads=2)
    before_v, before_s = np.asarray(before_v), None if before_s is None else np.asarray(before_s)
    assert np.isfinite(before_v.astype(np.float32)).all()
    assert (before_s is None) == (kv_dtype == "auto")
    for i in range(4):  # other prompts push the document out of the pool
        e.generate([[100 + i] * 40], SamplingParams(max_tokens=2))
    e.runner.kv_offload.poll(wait=True)
    assert not any(h in bm.cached for h in hashes)
    for i, h in enumerate(hashes):
        block = tier.blocks[h]
        assert block.values.shape == (4, 8, 4, 32)  # [L, P, 2*Hkv, D]: all layers of the page
        assert np.array_equal(bits(block.values), bits(before_v[i]))
        if before_s is not None:
            assert np.array_equal(bits(block.scales), bits(before_s[i]))
    out = e.generate([prompt], SamplingParams(max_tokens=1))[0]
    assert out.cached_tokens == 32
    new_pages = [bm.cached[h] for h in hashes]
    after_v, after_s = gather_blocks(e.runner.kv_cache.pages, np.asarray(new_pages, np.int32), num_kv_heads=2)
    assert np.array_equal(bits(np.asarray(after_v)), bits(before_v))
    if before_s is not None:
        assert np.array_equal(bits(np.asarray(after_s)), bits(before_s))


def test_host_tier_with_scanned_layers(plain):
    """engine.scan_layers stacks the cache [L, ...]: blocks still hold every layer in order."""
    tiered = wl.run(engine(**TIER, **{"engine.scan_layers": True}))
    assert tiered["tokens"] == plain["tokens"]
    assert tiered["stats"]["host_kv_hit_tokens"] > 0


def test_budget_smaller_than_a_page_keeps_nothing(plain):
    tiered = wl.run(engine(**{"engine.host_kv_cache_gb": 1e-9}))
    assert tiered["tokens"] == plain["tokens"]
    st = tiered["stats"]
    assert st["host_kv_pages_used"] == 0 and st["host_kv_cache_bytes"] == 0 and st["host_kv_hit_tokens"] == 0
    assert st["host_kv_dropped"] > 0


def test_budget_of_two_pages_holds_two(plain):
    block_bytes = 4 * 8 * 4 * 32 * 4  # [L, P, 2*Hkv, D] f32
    tiered = wl.run(engine(**{"engine.host_kv_cache_gb": 2.5 * block_bytes / 2**30}))
    assert tiered["tokens"] == plain["tokens"]
    st = tiered["stats"]
    assert st["host_kv_pages_used"] == 2 and st["host_kv_cache_bytes"] == 2 * block_bytes
    assert st["host_kv_saved"] > 2  # older blocks made room for newer ones


def _evicted_document(e: Engine, doc: list[int]) -> None:
    e.generate([doc + [7]], SamplingParams(max_tokens=1))
    for i in range(4):
        e.generate([[120 + i] * 40], SamplingParams(max_tokens=2))
    e.runner.kv_offload.poll(wait=True)


def test_failed_restore_recomputes_and_forgets_the_blocks():
    doc = list(range(40, 73))
    params = SamplingParams(max_tokens=6, temperature=0.7, seed=5)
    want = engine().generate([doc + [9]], params)[0].token_ids
    e = engine(**TIER)
    _evicted_document(e, doc)
    tier = e.runner.kv_offload.tier
    hashes = prefix_hashes(doc + [9], 8)
    assert all(h in tier.blocks for h in hashes)

    def broken(pages):
        raise RuntimeError("host-to-device copy failed")

    e.runner.restore = broken
    out = e.generate([doc + [9]], params)[0]
    assert out.token_ids == want and out.finish_reason == "length"
    assert out.cached_tokens == 0  # recomputed, not served from the blocks that failed
    assert not any(h in tier.blocks for h in hashes)
    st = e.stats()
    assert st["pages_free"] == st["pages_total"] and st["num_errors"] == 0


def test_abort_right_after_a_restore_returns_the_pages():
    doc = list(range(80, 113))
    e = engine(**TIER)
    _evicted_document(e, doc)
    rid = e.add_request(doc + [9], SamplingParams(max_tokens=50))
    e.step()  # admitted: blocks restored and its first chunk dispatched
    req = e.requests[rid]
    assert req.cached_tokens == 32 and e.runner.kv_offload.num_restored >= 4
    assert e.abort(rid)
    while e.has_unfinished():
        e.step()
    st = e.stats()
    assert st["pages_free"] == st["pages_total"]
    want = engine().generate([doc + [11]], SamplingParams(max_tokens=4))[0].token_ids
    again = e.generate([doc + [11]], SamplingParams(max_tokens=4))[0]
    assert again.token_ids == want and again.cached_tokens == 32


def test_host_tier_lru_and_budget_unit():
    def block(i):
        return KVBlock(np.full((2, 4, 2, 8), i, np.float32), None, None, (i,) * 4)

    nbytes = block(0).nbytes
    events = []
    tier = HostKVTier(3 * nbytes)
    tier.listener = lambda *ev: events.append(ev[0] + ":" + ev[-1])
    for i in range(3):
        tier.put(bytes([i]), block(i))
    assert tier.peek(bytes([0])) == "host" and tier.take(bytes([0])).tokens == (0,) * 4  # now the most recent
    tier.put(bytes([3]), block(3))  # pushes out 1, the least recently used
    assert bytes([1]) not in tier and bytes([0]) in tier
    assert tier.nbytes == 3 * nbytes and len(tier.blocks) == 3
    assert events.count("removed:host") == 1 and events.count("stored:host") == 4
    tier.put(b"big", KVBlock(np.zeros((1000,), np.float32), None, None, ()))  # over the budget alone
    assert b"big" not in tier and tier.counts.dropped == 1


@pytest.mark.parametrize("overrides,match", [
    ({"engine.host_kv_cache_gb": -1}, "host_kv_cache_gb"),
    ({"engine.host_kv_cache_gb": 1, "engine.enable_prefix_caching": False}, "enable_prefix_caching"),
    ({"engine.disk_kv_cache_dir": "/tmp/x", "engine.host_kv_cache_gb": 1}, "disk_kv_cache_gb"),
    ({"engine.disk_kv_cache_dir": "/tmp/x", "engine.disk_kv_cache_gb": 1}, "host_kv_cache_gb"),
])
def test_bad_tier_settings_are_refused(overrides, match):
    from jaxfill import load_config

    with pytest.raises(ConfigError, match=match):
        load_config("tiny_random", overrides)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [{"mesh.tensor": 2}, {"mesh.data": 2}], ids=["tensor2", "data2"])
def test_host_tier_under_a_mesh_gives_the_single_device_tokens(plain, mesh):
    """Fake devices in a subprocess: tensor=2 splits each block's heads over two devices;
    data=2 has two pools that evict into, and restore from, the one shared host tier."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, XLA_FLAGS=fake_devices(2))
    out = subprocess.run([sys.executable, os.path.join(root, "tests", "kv_tier_workload.py"),
                          json.dumps({**TIER, **mesh})], cwd=root, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["tokens"] == plain["tokens"]
    assert r["stats"]["host_kv_hit_tokens"] > 0
    assert r["stats"]["pages_free"] == r["stats"]["pages_total"]


def test_tier_events_and_metrics_name_the_tier():
    """KV events tell a gateway which tier holds a block (vLLM protocol tiers); Prometheus
    counts hits and queries per tier, in tokens."""
    from smg_grpc_proto.generated import common_pb2 as cpb

    from jaxfill.serving.metrics import ServerMetrics
    from jaxfill.serving.vllm_convert import kv_batch_to_proto

    e = engine(**TIER)
    events = []
    e.set_kv_event_listener(lambda replica, *ev: events.append((replica, ev)))
    metrics = ServerMetrics(model_name="m")
    metrics.update_stats(e.stats())  # the baseline
    doc = list(range(10, 43))
    _evicted_document(e, doc)
    e.generate([doc + [5]], SamplingParams(max_tokens=1))
    metrics.update_stats(e.stats())
    host = [ev for _, ev in events if ev[-1] == "host"]
    assert {ev[0] for ev in host} >= {"stored"} and all(r == 0 for r, ev in events if ev[-1] == "host")
    batch = kv_batch_to_proto((1, 0.0, 0, [ev for _, ev in events], 1), page_size=8)
    tiers = {(x.WhichOneof("data"), getattr(x, x.WhichOneof("data")).tier) for x in batch.events
             if x.WhichOneof("data") != "cleared"}
    assert ("stored", cpb.KV_CACHE_TIER_HOST) in tiers and ("stored", cpb.KV_CACHE_TIER_DEVICE) in tiers
    stored_host = [x.stored for x in batch.events if x.WhichOneof("data") == "stored"
                   and x.stored.tier == cpb.KV_CACHE_TIER_HOST]
    pages = [list(x.blocks[0].token_ids) for x in stored_host]  # the page's tokens travel with it
    assert all(doc[i:i + 8] in pages for i in range(0, 32, 8))
    st = e.stats()
    hits = metrics.registry.get_sample_value("jaxfill_host_prefix_cache_hits_total", {"model_name": "m"})
    assert hits == st["host_kv_hit_tokens"] == 32
    assert metrics.registry.get_sample_value("jaxfill_kv_tier_usage_bytes",
                                             {"model_name": "m", "tier": "host"}) == st["host_kv_cache_bytes"] > 0


def test_saves_and_restores_larger_than_one_call_split_and_stay_exact():
    """70 pages: more than MAX_PAGES_PER_CALL, so two gathers and two scatters."""
    import dataclasses

    import jax.numpy as jnp

    from jaxfill.engine.kv_tier.page_offload import MAX_PAGES_PER_CALL, KVOffload

    @dataclasses.dataclass
    class Cache:
        pages: tuple

    n = 70
    assert n > MAX_PAGES_PER_CALL
    rng = np.random.default_rng(1)
    pool = [rng.standard_normal((2 * n + 1, 4, 2, 8)).astype(np.float32) for _ in range(3)]  # 3 layers
    cache = Cache(tuple(jnp.asarray(a) for a in pool))
    offload = KVOffload(HostKVTier(1 << 30), num_kv_heads=1, pages_per_replica=2 * n + 1, stages=1,
                        max_staged_pages=1000)
    for p in range(1, n + 1):
        offload.on_evict(0, p, bytes([p]), None, ())
    offload.save_evicted(cache)
    assert len(offload.in_transit) == 2
    offload.poll(wait=True)
    blocks = [offload.tier.blocks[bytes([p])] for p in range(1, n + 1)]
    assert all(np.array_equal(b.values, np.stack([a[p] for a in pool])) for p, b in zip(range(1, n + 1), blocks))
    new = offload.restore(cache, list(range(n + 1, 2 * n + 1)), blocks)
    for layer, a in enumerate(new):
        assert np.array_equal(np.asarray(a)[n + 1:], pool[layer][1:n + 1])
        assert np.array_equal(np.asarray(a)[:n + 1], pool[layer][:n + 1])  # nothing else written
