"""Prefix caching of a linear-attention hybrid (Qwen3.5, random init) through recurrent-state
snapshots (engine/scheduler/state_snapshots.py): requests that share and diverge from
prefixes, with state slots reused by other requests in between (the tpu-inference #3412
failure: a hit read a reused slot holding another request's state), give each prompt's
greedy tokens of the model-level loop alone on a fresh NaN-filled cache; hits do happen;
snapshots are evicted under a small snapshot pool; aborts and preemptions leave nothing
behind; sync and async scheduling."""

import numpy as np
import pytest

from hf_models import make_hf_checkpoint
from jaxfill.engine.block_manager import prefix_hashes
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
from jaxfill.engine.scheduler.state_snapshots import StateSnapshots
from jaxfill.engine.simple import generate_one
from jaxfill.models.checkpoint import load_hf_params
from jaxfill.models.config import ConfigError
from jaxfill.engine.config import load_config
from jaxfill.models.families.registry import config_from_hf
from jaxfill.models.kv_cache import KVCache
from fast_engine import REFERENCE_ATTENTION

NEW = 5
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
BASE = {**REFERENCE_ATTENTION,  # tests/fast_engine.py
        "engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64], "engine.num_pages": 64,
        "engine.max_model_len": 128, "engine.max_num_seqs": 2, "engine.kv_fill_value": float("nan"),
        "engine.state_snapshot_tokens": 16}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """Prompts in families: a shared root, branches off it at 16/32/40 tokens, and prompts
    that are exactly a boundary long or one token past one."""
    directory = make_hf_checkpoint(str(tmp_path_factory.mktemp("hybrid_prefix") / "qwen3_5"), "qwen3_5")
    config = config_from_hf(directory)
    model = load_hf_params(directory, config, progress=False)
    rng = np.random.default_rng(11)
    ids = lambda n: [int(t) for t in rng.integers(0, config.vocab_size, n)]  # noqa: E731
    root, other = ids(40), ids(36)
    prompts = [root + ids(9), root[:32] + ids(13), root + ids(3), other + ids(5), root[:16] + ids(1),
               root[:33], other[:32] + ids(20), root + ids(17)]
    want = [generate_one(model, p, KVCache.create(config, 8, 16, fill_value=float("nan")), NEW)[0] for p in prompts]
    return directory, prompts, want


def engine(directory, **overrides) -> Engine:
    return Engine.from_config("tiny", model_path=directory, overrides={**BASE, **overrides}, progress=False)


def all_back(e: Engine) -> bool:
    st = e.stats()
    sch = e.scheduler.replicas[0]
    return st["pages_free"] == st["pages_total"] and len(sch.free_slots) == e.config.engine.state_slots


@pytest.mark.slow  # 89 s in a full run (2026-12-07, 2 loaded cores)
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_shared_prefixes_resume_from_snapshots_in_their_own_slots(hybrid, async_scheduling):
    """Waves of two slots: each wave's requests find the snapshots earlier waves left,
    copied into slots other requests used meanwhile."""
    directory, prompts, want = hybrid
    e = engine(directory, **{"engine.async_scheduling": async_scheduling})
    assert e.config.engine.enable_prefix_caching and e.config.engine.state_snapshot_slots == 2
    got = []
    for i in range(0, len(prompts), 2):
        got += [c.token_ids for c in e.generate(prompts[i:i + 2], GREEDY)]
    assert got == want
    st = e.stats()
    assert st["state_snapshot_hits"] >= 2 and st["cached_tokens_total"] >= 2 * 16, st
    assert st["state_snapshots_taken"] > st["state_snapshots_kept"]  # evicted: 2 slots
    assert all_back(e)


def test_many_snapshots_and_repeats_equal_prefix_caching_off(hybrid):
    """Every prompt twice, interleaved, with snapshots for all: hits at 16, 32 and 48
    tokens; the tokens equal an engine without prefix caching."""
    directory, prompts, want = hybrid
    e = engine(directory, **{"engine.state_snapshot_slots": 32})
    off = engine(directory, **{"engine.state_snapshot_tokens": 0})
    assert not off.config.engine.enable_prefix_caching and off.scheduler.replicas[0].snapshots is None
    twice = prompts + prompts[::-1]
    got = [c.token_ids for c in e.generate(twice, GREEDY)]
    assert got == [c.token_ids for c in off.generate(twice, GREEDY)] == want + want[::-1]
    assert e.stats()["state_snapshot_hits"] >= len(prompts)
    assert all_back(e)


def test_abort_and_preemption_with_snapshots(hybrid):
    """An abort mid-prefill, then a pool small enough to preempt: the survivors' tokens
    stand, every page and slot comes back, and the snapshots then serve new requests."""
    directory, prompts, want = hybrid
    e = engine(directory, **{"engine.num_pages": 7, "engine.max_num_seqs": 3, "engine.max_num_batched_tokens": 16,
                             "engine.token_buckets": [16]})
    e.add_request(prompts[7], GREEDY, request_id="long")
    e.step()
    assert e.abort("long")
    got = e.generate([prompts[0], prompts[1], prompts[7]], GREEDY)
    assert [c.token_ids for c in got] == [want[0], want[1], want[7]]
    assert e.stats()["num_preemptions"] > 0
    assert all_back(e)
    got = e.generate([prompts[2], prompts[5]], GREEDY)
    assert [c.token_ids for c in got] == [want[2], want[5]]
    assert all_back(e)


def test_snapshot_interval_must_be_whole_pages(hybrid):
    with pytest.raises(ConfigError, match="state_snapshot_tokens"):
        load_config("tiny", {"engine.state_snapshot_tokens": 24}, model_path=hybrid[0])


# ---------------------------------------------------------------------- bookkeeping alone
def test_cuts_and_boundaries():
    s = StateSnapshots(interval=32, first_slot=4, num_slots=2)
    assert s.cut(0, 100, known=100) == 32  # ends on the first boundary
    assert s.cut(32, 100, known=100) == 32
    assert s.cut(40, 20, known=100) == 20  # no boundary inside
    assert s.cut(40, 30, known=60) == 30  # the boundary's tokens are not known yet
    assert s.boundary(0, 32, known=32) == 32 and s.boundary(60, 1, known=60) is None
    assert s.boundary(63, 1, known=64) == 64 and s.boundary(0, 0, known=0) is None


def test_resume_needs_a_snapshot_at_a_boundary_and_eviction_prefers_stale():
    hashes = prefix_hashes(list(range(96)), 8)  # 12 pages, boundaries every 4
    s = StateSnapshots(interval=32, first_slot=4, num_slots=2)
    assert s.resume_pages(hashes, 8) == 0
    s.record(0, hashes[3])
    s.record(1, hashes[3])  # the same prefix twice: one snapshot
    s.record(1, hashes[7])
    assert s.resume_pages(hashes, 8) == 0  # not copied yet
    assert s.take_copies(lambda h: True) == [(0, 4), (1, 5)]
    assert s.resume_pages(hashes, 8) == 8 and s.resume_pages(hashes[:7], 8) == 4
    assert s.source(hashes[3]) == (4, None)  # now most recent
    s.record(2, hashes[11])
    assert s.take_copies(lambda h: True) == [(2, 5)]  # LRU: hashes[7] goes
    assert s.resume_pages(hashes, 8) == 12
    assert s.take_copies(lambda h: True) == []  # nothing pending; hashes[11]'s page seen cached
    s.record(3, hashes[7])
    assert s.take_copies(lambda h: h != hashes[11]) == [(3, 5)]  # stale first, though more recent
    assert s.resume_pages(hashes, 8) == 8


def test_a_snapshot_whose_page_is_not_cached_yet_is_not_stale():
    """Async scheduling: a snapshot taken for the step in flight has a boundary page the
    prefix cache registers only when that step's results return. Evicting it as stale
    would drop the newest snapshot every time (prefix hits then depend on luck with 2 slots)."""
    hashes = prefix_hashes(list(range(96)), 8)
    s = StateSnapshots(interval=32, first_slot=4, num_slots=2)
    registered = {hashes[3]}
    s.record(0, hashes[3])
    s.record(1, hashes[7])  # its page not registered yet
    assert s.take_copies(registered.__contains__) == [(0, 4), (1, 5)]
    s.record(2, hashes[11])
    assert s.take_copies(registered.__contains__) == [(2, 4)]  # LRU: hashes[3], not the young hashes[7]
    assert hashes[7] in s.slots
    s.clear()
    assert s.resume_pages(hashes, 8) == 0 and sorted(s.free) == [4, 5]


@pytest.mark.slow  # 99 s in a full run (2026-12-07, 2 loaded cores)
def test_qwen3_next_through_the_engine_with_snapshots(tmp_path):
    """Qwen3-Next (MoE hybrid): prompts sharing a 32-token root, in two waves so the second
    resumes from snapshots, equal the model-level loop alone."""
    directory = make_hf_checkpoint(str(tmp_path / "qwen3_next"), "qwen3_next")
    config = config_from_hf(directory)
    model = load_hf_params(directory, config, progress=False)
    rng = np.random.default_rng(12)
    root = [int(t) for t in rng.integers(0, config.vocab_size, 32)]
    prompts = [root + [int(t) for t in rng.integers(0, config.vocab_size, n)] for n in (7, 18, 1, 12)]
    want = [generate_one(model, p, KVCache.create(config, 8, 16, fill_value=float("nan")), NEW)[0] for p in prompts]
    e = engine(directory)
    got = [c.token_ids for c in e.generate(prompts[:2], GREEDY) + e.generate(prompts[2:], GREEDY)]
    assert got == want
    assert e.stats()["state_snapshot_hits"] >= 2
    assert all_back(e)

