"""Context parallelism end to end: the KV pool split over mesh.sequence serves what one
device serves, token for token.

Each configuration runs tests/context_worker.py in its own process (fake CPU devices):
a 1536-token prompt (one unchunked step; 512 in the short runs), a prompt sharing its
first two thirds (a prefix-cache hit of whole pages), and with `long` a 4000-token
prompt (2 chunks of 2048) whose 250 pages exceed what one device holds under sequence=4
(288 / 4 = 72), then an abort after the first chunk of a 3072-token prefill. Compared
with one device holding the whole pool: greedy tokens, first-token logprobs, prefix
hits, and the pool's bytes per device read from the shards (a 1/N share on every
device). Why this file takes over a minute: seven engines, two through a 4k prefill.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from xla_flags import fake_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = {"engine.attention_impl": "reference", "model.max_position_embeddings": 4608, "engine.max_model_len": 4608,
        "engine.max_num_batched_tokens": 2048, "engine.max_num_seqs": 4, "engine.num_pages": 288}
PAGES_OF_LONG = 4000 // 16


def run(devices: int, overrides: dict, long: bool = False, mid: int = 1536, abort: bool = True) -> dict:
    env = dict(os.environ, XLA_FLAGS=fake_devices(devices), JAX_PLATFORMS="cpu")
    spec = json.dumps({"overrides": {**BASE, **overrides}, "long": long, "mid": mid, "abort": abort})
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "context_worker.py"), spec],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def one_device():
    return run(1, {}, long=True)


def same_answers(got: dict, want: dict) -> None:
    """Equal on the prompts both ran (`want` may have run the long one too)."""
    n = len(got["tokens"])
    assert got["tokens"] == want["tokens"][:n]
    assert max(abs(a - b) for a, b in zip(got["logprob"], want["logprob"])) < 1e-4
    assert got["cached"] == want["cached"][:n] and got["cached"][1] > 0  # the prefix hit
    assert got["free_after"] == got["pages_total"]  # finished requests hold nothing


def split_evenly(r: dict, n: int) -> None:
    assert r["kv_bytes_device"] * n == r["kv_bytes"], r
    assert r["device_shares"] == [r["kv_bytes_device"]], r  # every device the same share


@pytest.fixture(scope="module")
def sequence4():
    return run(4, {"mesh.sequence": 4}, long=True)


@pytest.mark.slow
def test_sequence4_serves_a_prompt_larger_than_a_device_share(one_device, sequence4):
    r = sequence4
    assert BASE["engine.num_pages"] // 4 < PAGES_OF_LONG < BASE["engine.num_pages"]
    same_answers(r, one_device)
    split_evenly(r, 4)
    assert one_device["kv_bytes_device"] == one_device["kv_bytes"] == r["kv_bytes"]


@pytest.mark.slow  # it needs both long-prompt engines: 160 s of leg 2 (CI) for an abort
def test_abort_mid_prefill_gives_every_page_back(one_device, sequence4):
    for r in (one_device, sequence4):
        assert r["free_mid_prefill"] < r["pages_total"]  # the first chunk holds pages
        assert r["free_after_abort"] == r["pages_total"]


@pytest.fixture(scope="module")
def one_device_short():
    return run(1, {}, mid=512, abort=False)


@pytest.mark.slow
def test_pass_kv_ring_equals_one_device(one_device_short):
    """model.context_attention = pass_kv: the fresh first prompt (512 tokens: the ring's
    dense blocks are slow on CPU) takes the ring, the prefix hit pass-Q. With data
    replicas one replica's step may be fresh while the other's is not: both take one
    branch (a deadlock on XLA:CPU otherwise). tests/test_context_mesh.py holds the ring
    to the float64 oracle on sequence = 4."""
    r = run(4, {"mesh.data": 2, "mesh.sequence": 2, "model.context_attention": "pass_kv"}, mid=512, abort=False)
    assert r["cached"][1] == 336
    same_answers(r, one_device_short)
    split_evenly(r, 4)  # data splits the pages too (a pool per replica)


@pytest.mark.slow
def test_odd_rank_count(one_device_short):
    """sequence=3: pages dealt over three ranks (288 = 3 x 96), bucket rows rounded up
    to a multiple of 3; aborts free per rank."""
    r = run(3, {"mesh.sequence": 3}, mid=512)
    same_answers(r, one_device_short)
    split_evenly(r, 3)
    assert r["free_mid_prefill"] < r["pages_total"] == r["free_after_abort"]


@pytest.mark.slow
def test_int8_kv_with_tensor2_sequence2():
    over = {"engine.kv_cache_dtype": "int8"}
    ref = run(1, over, mid=512, abort=False)
    r = run(4, {**over, "mesh.tensor": 2, "mesh.sequence": 2}, mid=512, abort=False)
    same_answers(r, ref)
    split_evenly(r, 4)  # heads over tensor, pages over sequence: a quarter each


def test_pool_must_split_over_sequence():
    from jaxfill.engine.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="multiple of 4"):
        load_config("tiny_random", {"mesh.sequence": 4, "engine.num_pages": 1150})
