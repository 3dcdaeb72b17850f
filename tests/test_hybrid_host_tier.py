"""A linear-attention hybrid's prefix cache with the host tier (Qwen3.5, random init): the
state snapshot at a page boundary leaves the device with its slot and lives in the host
tier beside the KV blocks (engine/kv_tier/snapshot_offload.py); a host hit writes the pages and
the snapshot back, the snapshot into the request's own fresh slot. Documents outnumber a
small device pool and its two snapshot slots, so later rounds resume from the host; the
tokens equal prefix caching off, on NaN-filled unused pages and slots. A restore that
skips the snapshot write gives other tokens (the check can fail); a host hit whose
snapshot is gone is cut back to one that is kept."""

import numpy as np
import pytest

from hf_models import make_hf_checkpoint
from jaxfill.engine.block_manager import prefix_hashes
from jaxfill.engine.engine import Engine
from jaxfill.engine.kv_tier.host import HostKVTier, KVBlock, StateSnapshot
from jaxfill.engine.request import SamplingParams
from jaxfill.engine.runner import Runner
from jaxfill.engine.scheduler.state_snapshots import StateSnapshots

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
# page_size 8, snapshots every 16 tokens into 2 slots; 13 usable pages hold two 37-token
# requests (6 pages each) and little else, so most prefixes leave for the host.
BASE = {"engine.page_size": 8, "engine.num_pages": 14, "engine.max_num_batched_tokens": 16,
        "engine.token_buckets": [16], "engine.max_model_len": 64, "engine.max_num_seqs": 2,
        "engine.kv_fill_value": float("nan"), "engine.state_snapshot_tokens": 16,
        "engine.state_snapshot_slots": 2}
TIER = {"engine.host_kv_cache_gb": 0.002}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """Rounds over four 32-token documents (whole, or cut to 19 tokens) with new questions;
    and the tokens of an engine without prefix caching."""
    directory = make_hf_checkpoint(str(tmp_path_factory.mktemp("hybrid_host") / "qwen3_5"), "qwen3_5")
    rng = np.random.default_rng(5)
    ids = lambda n: [int(t) for t in rng.integers(1, 250, n)]  # noqa: E731
    docs = [ids(32) for _ in range(4)]
    prompts = [(docs[i] if (r + i) % 3 else docs[i][:19]) + ids(5) for r in range(3) for i in rng.permutation(4)]
    off = engine(directory, **{"engine.state_snapshot_tokens": 0})
    assert not off.config.engine.enable_prefix_caching
    return directory, prompts, run(off, prompts)


def engine(directory, **overrides) -> Engine:
    return Engine.from_config("tiny", model_path=directory, overrides={**BASE, **overrides}, progress=False)


def run(e: Engine, prompts) -> list:
    out = []
    for k in range(0, len(prompts), 2):
        out += [c.token_ids for c in e.generate(prompts[k:k + 2], GREEDY)]
    return out


def test_host_tier_snapshots_resume_like_prefix_caching_off(hybrid):
    directory, prompts, want = hybrid
    e = engine(directory, **TIER)
    assert run(e, prompts) == want
    e.runner.kv_offload.flush()
    st = e.stats()
    print({k: v for k, v in st.items() if "snapshot" in k or k.startswith("host_kv")})
    assert st["host_state_snapshots_restored"] >= 1 and st["host_kv_hits"] >= 1, st
    assert st["host_state_snapshots"] >= 1 and st["host_kv_cache_bytes"] <= st["host_kv_cache_budget_bytes"]
    sch = e.scheduler.replicas[0]
    assert st["pages_free"] == st["pages_total"] and len(sch.free_slots) == e.config.engine.state_slots
    states = [x for x in e.runner.kv_cache.pages if hasattr(x, "recurrent")]
    assert np.isnan(np.asarray(states[0].recurrent[-1])).all()  # the null slot was never written


def test_skipping_the_snapshot_write_is_caught(hybrid, monkeypatch):
    """Mutation: a host hit that writes the pages but not the snapshot resumes from whatever
    its slot held (NaN, or another request's state): other tokens."""
    directory, prompts, want = hybrid
    monkeypatch.setattr(Runner, "restore_state", lambda self, h, slot: self.kv_offload.states.tier.has_snapshot(h))
    e = engine(directory, **TIER)
    assert run(e, prompts) != want


def test_a_host_hit_without_its_snapshot_is_cut_back(hybrid):
    """Every snapshot dropped from the host tier before the last round, and none saved
    after: the pages still come back from the host, but hits stop at the snapshots the
    device still holds, and the tokens stand."""
    directory, prompts, want = hybrid
    e = engine(directory, **TIER)
    got = run(e, prompts[:8])
    offload = e.runner.kv_offload
    offload.flush()
    offload.tier.discard(*[k for k, b in offload.tier.blocks.items() if isinstance(b, StateSnapshot)])
    offload.states.save = lambda cache, saves: None
    # the case: a prompt whose first boundary page (16 tokens) only the host holds
    assert any(offload.tier.peek(prefix_hashes(p, 8)[1]) == "host" for p in prompts[8:])
    before = e.stats()["host_state_snapshots_restored"]
    assert got + run(e, prompts[8:]) == want
    assert e.stats()["host_state_snapshots_restored"] == before


# ---------------------------------------------------------------------- bookkeeping alone
def test_snapshots_leaving_their_slots_and_resuming_from_the_host():
    hashes = prefix_hashes(list(range(64)), 8)  # 8 pages, boundaries every 2
    on_host = set()
    s = StateSnapshots(interval=16, first_slot=4, num_slots=1, on_host=on_host.__contains__)
    s.record(0, hashes[1])
    assert s.take_copies(lambda h: True) == [(0, 4)] and s.take_evicted() == []  # a free slot
    s.record(1, hashes[3])
    s.record(2, hashes[5])  # both in one call: hashes[3] never reaches its slot
    assert s.take_copies(lambda h: True) == [(2, 4)]
    assert s.take_evicted() == [(4, hashes[1])]  # saved before the copy reuses slot 4
    assert s.resume_pages(hashes, 8) == 6  # hashes[5] on the device
    on_host.add(hashes[1])
    assert s.resume_pages(hashes[:5], 8) == 2  # hashes[3]'s snapshot is nowhere
    assert s.source(hashes[1]) == (None, hashes[1]) and s.source(hashes[5]) == (4, None)
    assert s.host_hits == 1 and s.hits == 2


def test_snapshots_share_the_tier_budget_and_make_no_kv_events():
    events = []
    tier = HostKVTier(budget_bytes=3000)
    tier.listener = lambda *ev: events.append(ev[0])
    block = KVBlock(np.zeros((2, 8, 4, 16), np.float32), None, None, (1,) * 8)  # 4096 bytes: never fits
    tier.put(b"k" * 16, block)
    assert tier.counts.dropped == 1
    small = KVBlock(np.zeros((1, 8, 2, 16), np.float32), None, None, (1,) * 8)  # 1024 bytes
    snap = StateSnapshot(np.ones((1, 4, 8, 8), np.float32), np.ones((1, 8, 3), np.float32))  # 1120 bytes
    tier.put(b"a" * 16, small)
    tier.put_snapshot(b"a" * 16, snap)
    assert tier.has_snapshot(b"a" * 16) and tier.peek(b"a" * 16) == "host"
    tier.put(b"b" * 16, small)  # 3168 bytes: the least recently used (the page) goes
    assert tier.peek(b"a" * 16) is None and tier.get_snapshot(b"a" * 16) is snap
    st = tier.stats()
    assert st["host_kv_pages_used"] == 1 and st["host_state_snapshots"] == 1 and st["host_kv_cache_bytes"] == 2144
    assert events == ["stored", "removed", "stored"]
    tier.clear()
    assert tier.stats()["host_state_snapshots"] == 0 and tier.get_snapshot(b"a" * 16) is None
