"""The MTP proposer under mesh.tensor = 2 (fake CPU devices in a subprocess): the MTP layer
is built from the target's sharded layer code (MLA heads and the MoE split over tensor), its
cache entry sharded like the target's; outputs with mtp equal outputs without, proposals of
the copying layer (tests/mtp_checkpoints.py) are accepted, and every page comes back."""

import json
import os
import subprocess
import sys

import pytest
from xla_flags import fake_devices

from mtp_checkpoints import make_mtp_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = """
import json, sys
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
base = {"engine.max_num_batched_tokens": 32, "engine.token_buckets": [8, 32], "engine.num_pages": 48,
        "engine.max_model_len": 128, "engine.max_num_seqs": 4, "engine.page_size": 8, "mesh.tensor": 2,
        "engine.attention_impl": "reference", "speculative.backoff_window": 0}
prompts = [[5, 17, 33, 42, 99, 7, 8] * 3, [3, 1, 4, 1, 5, 9, 2, 6]]
params = [SamplingParams(max_tokens=24), SamplingParams(max_tokens=16)]
out = {}
for name, extra in (("plain", {}), ("mtp", {"speculative.method": "mtp", "speculative.num_tokens": 1})):
    eng = Engine.from_config("tiny_random", overrides={**base, **extra}, model_path=sys.argv[1], progress=False)
    res = eng.generate(prompts, params)
    st = eng.stats()
    out[name] = {"tokens": [c.token_ids for c in res], "accepted": st.get("spec_accepted_tokens"),
                 "free": st["pages_free"], "total": st["pages_total"], "mesh": dict(eng.runner.mesh.shape)}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_mtp_under_tensor_parallelism_keeps_the_output(tmp_path):
    """Slow (a subprocess compiling two sharded engines)."""
    directory, _ = make_mtp_checkpoint(str(tmp_path / "copying"), copying=True)
    env = dict(os.environ, XLA_FLAGS=fake_devices(2))
    res = subprocess.run([sys.executable, "-c", SCRIPT, directory], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["mtp"]["mesh"]["tensor"] == 2
    assert out["mtp"]["tokens"] == out["plain"]["tokens"]
    assert out["mtp"]["accepted"] > 0
    assert out["mtp"]["free"] == out["mtp"]["total"]
