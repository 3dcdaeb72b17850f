"""Engine.from_config with a [mesh] builds params straight into shards and gives the
single-device tokens (8 fake CPU devices in a subprocess: the device count is fixed at
backend start)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = """
import json, sys
from engine.engine import Engine
from engine.request import SamplingParams
overrides = json.loads(sys.argv[1])
engine = Engine.from_config("tiny", overrides=overrides, progress=False)
params = [SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, temperature=0.9, seed=3)]
out = engine.generate(["Hello there", "abc" * 30], params)
leaf = engine.runner.state["embed"]["embedding"][...]
print(json.dumps({"tokens": [c.token_ids for c in out], "mesh": dict(engine.runner.mesh.shape) if engine.runner.mesh else None,
                  "embed_rows_per_device": leaf.addressable_shards[0].data.shape[0], "vocab": leaf.shape[0], "free": engine.stats()["pages_free"],
                  "total": engine.stats()["pages_total"]}))
"""
BASE = {"engine.max_num_batched_tokens": 64, "engine.num_pages": 64}


def run(overrides, devices):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps({**BASE, **overrides})], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_sharded_engine_equals_one_device():
    single = run({}, 1)
    sharded = run({"mesh.tensor": 2, "mesh.sequence": 4}, 8)
    assert single["mesh"] is None and sharded["mesh"] == {"data": 1, "tensor": 2, "sequence": 4}
    assert sharded["embed_rows_per_device"] * 2 == sharded["vocab"]  # vocab split over tensor=2
    assert sharded["tokens"] == single["tokens"]
    assert sharded["free"] == sharded["total"]
