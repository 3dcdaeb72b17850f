"""update_weights empties the host and disk KV tiers: their blocks hold the old weights'
K/V. tiny_random with a 16-page pool (tests/kv_tier_workload.py) fills a small host tier
that pushes blocks out to disk; after an update from another seed's params no block is
left, no file either, and a document the tiers held is recomputed with the new weights."""

import os

import pytest

import kv_tier_workload as wl
from jaxfill import Engine, SamplingParams

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.mark.slow
def test_update_empties_host_and_disk_tiers(tmp_path):
    disk = str(tmp_path / "disk")
    tiers = {"engine.host_kv_cache_gb": 0.00005, "engine.disk_kv_cache_dir": disk, "engine.disk_kv_cache_gb": 0.01}
    e = Engine.from_config("tiny_random", overrides={**wl.BASE, **tiers}, progress=False)
    wl.run(e)
    e.runner.kv_offload.flush()
    st = e.stats()
    assert st["host_kv_pages_used"] > 0 and st["disk_kv_pages_used"] > 0
    prompt = wl.requests()[0][0][0]
    assert e.generate([prompt], GREEDY)[0].cached_tokens > 0  # held by a tier or the device cache
    other = Engine.from_config("tiny_random", overrides={**wl.BASE, "model.seed": 1}, progress=False)
    want = other.generate([prompt], GREEDY)[0].token_ids
    programs = e.stats()["compiled_programs"]
    e.update_weights(other.runner.state)
    st = e.stats()
    assert st["host_kv_pages_used"] == 0 and st["disk_kv_pages_used"] == 0
    assert not [f for f in os.listdir(disk) if f.endswith(".kvb")]
    got = e.generate([prompt], GREEDY)[0]
    assert got.cached_tokens == 0 and got.token_ids == want
    assert e.stats()["host_kv_hits"] == st["host_kv_hits"]
    assert e.stats()["compiled_programs"] == programs
