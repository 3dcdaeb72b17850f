"""A linear-attention hybrid's state snapshots on the disk tier (engine/kv_tier/disk.py,
disk_format.py), beside its prefix's pages: Qwen3.5 (Gated DeltaNet) and Granite 4.0-H
(Mamba2), random init, f32, NaN-filled unused pages and slots. The host tier (four pages) is
smaller than one snapshot, so every snapshot leaving its device slot goes straight to a
file; a repeated prompt resumes from it with the greedy tokens and logprobs of prefix
caching off. A restarted engine serves the files; a damaged or truncated snapshot file
is refused (deleted, counted) and its prompt recomputed, never resumed. Reading another
prefix's snapshot from disk gives other tokens or logprobs (the checks can fail); so does
skipping a disk snapshot's write, or its checksum (tried once by hand: those tests failed).
About 15 s (Qwen3.5) and 10 s (Granite) for the file's two fixtures on 2 cores."""

import os
import shutil

import numpy as np
import pytest

from hf_models import make_hf_checkpoint
from jaxfill.engine.block_manager import prefix_hashes
from jaxfill.engine.engine import Engine
from jaxfill.engine.kv_tier.host import HostKVTier, snapshot_key
from jaxfill.engine.request import SamplingParams
from test_kv_transfer import assert_same_logprobs

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, ignore_eos=True)
# page_size 8, snapshots every 16 tokens into 2 slots; 13 usable pages hold two 41-token
# requests, so a third document pushes the first one's pages and snapshots off the device.
BASE = {"engine.page_size": 8, "engine.num_pages": 14, "engine.max_num_batched_tokens": 16,
        "engine.token_buckets": [16], "engine.max_model_len": 64, "engine.max_num_seqs": 2,
        "engine.kv_fill_value": float("nan"), "engine.state_snapshot_tokens": 16,
        "engine.state_snapshot_slots": 2}
# host tiers of four pages (Qwen3.5's hold 4096 bytes, Granite's 2048), less than one
# snapshot (24192 and 20992 bytes)
HOST_BYTES = {"qwen3_5": 16384, "granitemoehybrid": 8192}
SNAPSHOT_FILE = snapshot_key(b"").hex() + ".kvb"  # how a snapshot's file name ends


def tiers(directory, checkpoint) -> dict:
    host = HOST_BYTES[os.path.basename(checkpoint)]
    return {"engine.host_kv_cache_gb": host / 2**30, "engine.disk_kv_cache_dir": str(directory),
            "engine.disk_kv_cache_gb": 0.01}


def engine(checkpoint, **overrides) -> Engine:
    return Engine.from_config("tiny", model_path=checkpoint, overrides={**BASE, **overrides}, progress=False)


def run(e: Engine, prompts) -> list:
    """Completions, two prompts a call (in order); between calls the tiers' saves and
    file writes are waited for, so which prefix a later call finds does not race them."""
    out = []
    for k in range(0, len(prompts), 2):
        out += e.generate(prompts[k:k + 2], GREEDY)
        if e.runner.kv_offload is not None:
            e.runner.kv_offload.flush()
    return out


def assert_same(got, want):
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want):
        assert_same_logprobs(g.logprobs, w.logprobs)


def all_back(e: Engine) -> bool:
    st = e.stats()
    return st["pages_free"] == st["pages_total"] and \
        len(e.scheduler.replicas[0].free_slots) == e.config.engine.state_slots


def null_slot_untouched(e: Engine) -> bool:
    states = [x for x in e.runner.kv_cache.pages if hasattr(x, "recurrent")]
    return bool(np.isnan(np.asarray(states[0].recurrent[-1])).all())


def workload():
    """Four 32-token documents with a question each, two a call, then the first prompt again
    and the second document with a new question: by then the first two documents' pages
    and snapshots have left the device (and the four-page host tier) for the disk."""
    rng = np.random.default_rng(7)
    ids = lambda n: [int(t) for t in rng.integers(1, 250, n)]  # noqa: E731
    docs = [ids(32) for _ in range(4)]
    first = [d + ids(5) for d in docs]
    return first + [first[0], docs[1] + ids(5)]


REPEATED = 4  # the workload's repeated prompt


@pytest.fixture(scope="module", params=["qwen3_5", "granitemoehybrid"])
def hybrid(request, tmp_path_factory):
    """The checkpoint, the prompts, prefix caching off's completions, a tiered engine's
    completions and stats, the disk directory it ran the workload into (closed: every
    file written), and whether its pages and slots came back."""
    root = tmp_path_factory.mktemp(f"hybrid_disk_{request.param}")
    checkpoint = make_hf_checkpoint(str(root / request.param), request.param)
    prompts = workload()
    off = engine(checkpoint, **{"engine.state_snapshot_tokens": 0})
    assert not off.config.engine.enable_prefix_caching
    want = run(off, prompts)
    e = engine(checkpoint, **tiers(root / "kv", checkpoint))
    got = run(e, prompts)
    st = e.stats()
    back = all_back(e) and null_slot_untouched(e)
    e.close()
    return checkpoint, prompts, want, got, st, root / "kv", back


def test_a_repeated_prompt_resumes_from_a_snapshot_on_disk(hybrid):
    checkpoint, prompts, want, got, st, directory, back = hybrid
    print({k: v for k, v in st.items() if "snapshot" in k or k.startswith(("host_kv", "disk_kv"))})
    assert_same(got, want)
    assert st["host_state_snapshots"] == 0 and st["host_kv_dropped"] == 0  # none fit the host: all went on
    assert st["disk_state_snapshot_hits"] >= 1 and st["host_state_snapshots_restored"] >= 1
    assert st["disk_kv_hits"] >= 1 and st["disk_state_snapshots"] >= 1
    assert got[REPEATED].cached_tokens == 32  # the whole document, its state from disk
    assert back
    names = os.listdir(directory)
    assert sum(n.endswith(SNAPSHOT_FILE) for n in names) == st["disk_state_snapshots"]
    assert sum(n.endswith(".kvb") for n in names) == st["disk_state_snapshots"] + st["disk_kv_pages_used"]


def on_disk(directory, prompts) -> list[int]:
    """The documents (first prompts) whose four pages and both snapshots are files."""
    names = set(os.listdir(directory))
    out = []
    for i, p in enumerate(prompts[:REPEATED]):
        h = prefix_hashes(p, 8)[:4]
        if all(x.hex() + ".kvb" in names for x in h) and \
                all(snapshot_key(h[k]).hex() + ".kvb" in names for k in (1, 3)):
            out.append(i)
    return out


def damage(path, truncate: bool) -> None:
    data = bytearray(open(path, "rb").read())
    if truncate:
        data = data[:len(data) // 2]
    else:
        data[-7] ^= 0x10  # one flipped bit in the conv array
    open(path, "wb").write(bytes(data))


def test_a_restart_serves_snapshots_and_refuses_damaged_ones(hybrid, tmp_path):
    """A new engine on a copy of the files, two documents kept whole on disk: one's two
    snapshots damaged (a flipped bit, cut in half), the other's whole. The first prompt
    recomputes (no cached tokens), the second resumes at 32 tokens from disk; both give
    prefix caching off's tokens and logprobs, and the damaged files are gone."""
    checkpoint, prompts, want, _, _, directory, _ = hybrid
    copy = tmp_path / "kv"
    shutil.copytree(directory, copy)
    kept = on_disk(copy, prompts)
    assert len(kept) >= 2, kept
    hurt, whole = kept[:2]
    bad = [copy / (snapshot_key(h).hex() + ".kvb") for h in prefix_hashes(prompts[hurt], 8)[1:4:2]]
    for i, p in enumerate(bad):
        damage(p, truncate=i == 1)
    e = engine(checkpoint, **tiers(copy, checkpoint))
    assert e.stats()["disk_state_snapshots"] >= 4
    got = run(e, [prompts[hurt], prompts[whole]])
    assert_same(got, [want[hurt], want[whole]])
    st = e.stats()
    assert st["disk_kv_corrupt"] == 2 and not any(p.exists() for p in bad)
    assert got[0].cached_tokens == 0 and got[1].cached_tokens == 32
    assert st["disk_state_snapshot_hits"] >= 1
    assert all_back(e) and null_slot_untouched(e)
    e.close()


def test_restoring_another_prefixs_snapshot_is_caught(hybrid, tmp_path, monkeypatch):
    """Mutation, on a restarted engine (every state comes from disk): a disk read that
    returns another document's snapshot at the same boundary gives other tokens or
    logprobs (Granite's tiny Mamba2 keeps its greedy tokens: the logprobs move). (Writing
    none, `restore_state` returning True untouched, fails the same way: tests/
    test_hybrid_host_tier.py keeps that one.)"""
    checkpoint, prompts, want, _, _, directory, _ = hybrid
    copy = tmp_path / "kv"
    shutil.copytree(directory, copy)
    kept = on_disk(copy, prompts)
    assert len(kept) >= 2, kept
    a, b = (prefix_hashes(prompts[i], 8) for i in kept[:2])
    swap = {a[1]: b[1], b[1]: a[1], a[3]: b[3], b[3]: a[3]}  # two documents' states, swapped
    real = HostKVTier.get_snapshot
    monkeypatch.setattr(HostKVTier, "get_snapshot", lambda self, h: real(self, swap.get(h, h)))
    e = engine(checkpoint, **tiers(copy, checkpoint))
    got = run(e, [prompts[i] for i in kept[:2]])
    assert got[0].cached_tokens == 32  # it did resume, from the wrong state
    with pytest.raises(AssertionError):  # other tokens, or logprobs more than 1e-5 apart
        assert_same(got, [want[i] for i in kept[:2]])
    print({os.path.basename(checkpoint): max(abs(g["logprob"] - w["logprob"]) for c, i in zip(got, kept)
                                             for g, w in zip(c.logprobs, want[i].logprobs))})
    e.close()


# ---------------------------------------------------------------------- the tiers alone
def test_snapshot_files_share_the_budget_and_refuse_damage(tmp_path):
    from jaxfill.engine.kv_tier.disk import DiskKVTier, decode, encode
    from jaxfill.engine.kv_tier.host import KVBlock, StateSnapshot

    rng = np.random.default_rng(0)
    snap = StateSnapshot(rng.random((1, 4, 8, 8), np.float32), rng.random((1, 8, 3), np.float32))  # 1120 bytes
    back = decode(encode(snap, "fp"), "fp")
    assert np.array_equal(back.recurrent, snap.recurrent) and np.array_equal(back.conv, snap.conv)
    with pytest.raises(ValueError):
        decode(encode(snap, "fp")[:-4], "fp")
    block = KVBlock(rng.random((1, 8, 2, 16), np.float32), None, None, (1,) * 8)  # 1024 bytes
    header = len(encode(block, "fp")) - block.nbytes  # a file's bytes beyond its arrays
    disk = DiskKVTier(str(tmp_path), 3 * 1024 + 1120 + 4 * header, "fp")
    tier = HostKVTier(budget_bytes=1100, disk=disk)  # a page fits, a snapshot does not
    pages = [bytes([i]) * 16 for i in range(4)]
    tier.put(pages[0], block)
    tier.put_snapshot(pages[0], snap)  # straight to disk
    tier.put(pages[1], block)  # pushes page 0 out to disk
    disk.flush()
    assert tier.has_snapshot(pages[0]) and not tier.has_snapshot(pages[1])
    st = tier.stats()
    assert (st["host_state_snapshots"], st["disk_state_snapshots"], st["disk_kv_pages_used"]) == (0, 1, 1)
    got = tier.get_snapshot(pages[0])
    assert np.array_equal(got.recurrent, snap.recurrent) and disk.snapshot_hits == 1
    for h in pages[2:]:  # two more page files: over the disk budget, the oldest file (page 0's) goes
        tier.put(h, block)
    tier.put(pages[0] + b"x", block)  # (pushes out page 3: 4 page files and the snapshot > budget)
    disk.flush()
    assert pages[0] not in disk and tier.has_snapshot(pages[0]) and disk.nbytes <= disk.budget_bytes
    # a block's file under a snapshot's name is refused and deleted, never served as a state
    disk.put(snapshot_key(pages[1]), block)
    disk.flush()
    assert tier.get_snapshot(pages[1]) is None and disk.corrupt == 1
    assert not os.path.exists(os.path.join(str(tmp_path), snapshot_key(pages[1]).hex() + ".kvb"))
    disk.close()
