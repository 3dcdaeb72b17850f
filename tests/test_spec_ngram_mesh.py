"""n-gram speculation under mesh.tensor = 2 (fake CPU devices in a subprocess: the device
count is fixed at backend start): the sharded engine's outputs with speculation equal
its outputs without, proposals are accepted, and every page comes back."""

import json
import os
import subprocess
import sys

import pytest
from xla_flags import fake_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = """
import json
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
base = {"engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64], "engine.num_pages": 64,
        "engine.max_model_len": 256, "engine.max_num_seqs": 4, "mesh.tensor": 2,
        "engine.attention_impl": "reference"}  # tests/fast_engine.py
prompts = [[5, 17, 33, 42, 99, 7, 8] * 5, [3, 1, 4, 1, 5, 9, 2, 6] * 4]
params = [SamplingParams(max_tokens=16), SamplingParams(max_tokens=16, temperature=0.8, seed=4)]
out = {}
for name, extra in (("plain", {}), ("spec", {"speculative.method": "ngram", "speculative.num_tokens": 3})):
    eng = Engine.from_config("tiny_random", overrides={**base, **extra}, progress=False)
    res = eng.generate(prompts, params)
    st = eng.stats()
    out[name] = {"tokens": [c.token_ids for c in res], "accepted": st.get("spec_accepted_tokens"),
                 "free": st["pages_free"], "total": st["pages_total"], "mesh": dict(eng.runner.mesh.shape)}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_speculation_under_tensor_parallelism_keeps_the_output():
    env = dict(os.environ, XLA_FLAGS=fake_devices(2))
    res = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["spec"]["mesh"]["tensor"] == 2
    assert out["spec"]["tokens"] == out["plain"]["tokens"]
    assert out["spec"]["accepted"] > 0
    assert out["spec"]["free"] == out["spec"]["total"]
