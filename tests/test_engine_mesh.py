"""Engine.from_config with a [mesh] builds params straight into shards and gives the
single-device tokens: tensor x sequence, and data replicas (each its own scheduler and
page pool) with and without tensor/sequence inside them. Fake CPU devices in a
subprocess: the device count is fixed at backend start."""

import json
import os
import subprocess
import sys

import pytest
from xla_flags import fake_devices
from fast_engine import REFERENCE_ATTENTION

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = """
import json, sys
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
overrides = json.loads(sys.argv[1])
engine = Engine.from_config("tiny_random", overrides=overrides, progress=False)
params = [SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, temperature=0.9, seed=3),
          SamplingParams(max_tokens=5, logprobs=2), SamplingParams(max_tokens=12, temperature=0.7, top_k=5, seed=9)]
out = engine.generate(["Hello there", "abc" * 30, "The quick brown fox", "x" * 70], params)
alone = engine.generate(["a lone prompt on one replica"], SamplingParams(max_tokens=6))
leaf = engine.runner.state["embed"]["embedding"][...]
pages = engine.runner.kv_cache.pages[0]
st = engine.stats()
print(json.dumps({"tokens": [c.token_ids for c in out + alone], "mesh": dict(engine.runner.mesh.shape) if engine.runner.mesh else None,
                  "logprob": out[2].logprobs[0]["logprob"],
                  "embed_rows_per_device": leaf.addressable_shards[0].data.shape[0], "vocab": leaf.shape[0],
                  "pages_per_device": pages.addressable_shards[0].data.shape[0], "pages_global": pages.shape[0],
                  "free": st["pages_free"], "total": st["pages_total"], "per_replica": st["requests_per_replica"]}))
"""
BASE = {**REFERENCE_ATTENTION,  # tests/fast_engine.py
        "engine.max_num_batched_tokens": 64, "engine.num_pages": 64}


def run(overrides, devices):
    env = dict(os.environ, XLA_FLAGS=fake_devices(devices))
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps({**BASE, **overrides})], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def single():
    r = run({}, 1)
    assert r["mesh"] is None and r["per_replica"] == [5]
    assert len({tuple(t) for t in r["tokens"]}) == 5
    return r


@pytest.mark.slow
def test_sharded_engine_equals_one_device(single):
    sharded = run({"mesh.tensor": 2, "mesh.sequence": 4}, 8)
    assert sharded["mesh"] == {"stage": 1, "data": 1, "tensor": 2, "expert": 1, "sequence": 4}
    assert sharded["embed_rows_per_device"] * 2 == sharded["vocab"]  # vocab split over tensor=2
    assert sharded["tokens"] == single["tokens"]
    assert sharded["free"] == sharded["total"]
    assert sharded["pages_per_device"] * 4 == sharded["pages_global"] == BASE["engine.num_pages"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh,devices", [((2, 1, 1), 2), ((2, 2, 2), 8)], ids=["d2", "d2t2s2"])
def test_data_replicas_equal_one_device(single, mesh, devices):
    d, t, s = mesh
    r = run({"mesh.data": d, "mesh.tensor": t, "mesh.sequence": s}, devices)
    assert r["mesh"] == {"stage": 1, "data": d, "tensor": t, "expert": 1, "sequence": s}
    assert r["tokens"] == single["tokens"]
    assert abs(r["logprob"] - single["logprob"]) < 1e-4
    # Each replica has its own pool of engine.num_pages pages, dealt over its sequence ranks.
    assert r["pages_global"] == d * BASE["engine.num_pages"] and r["pages_per_device"] == BASE["engine.num_pages"] // s
    assert r["total"] == d * (BASE["engine.num_pages"] - 1) and r["free"] == r["total"]
    assert r["per_replica"] == [3, 2]  # placed on the least-loaded replica
