"""A hybrid's host-tier snapshots under mesh.data = 2 (Qwen3.5, 2 fake CPU devices in a
subprocess): the rounds of tests/test_hybrid_host_tier.py spread over both replicas give
the tokens of prefix caching off on one device, with snapshots restored from the host
into slots of either replica. The restore writes the replica's own row of the state
arrays (models/linear_state.state_row); written into replica 0's row instead, the tokens
differ. Slow (~30 s: a subprocess whose two engines compile their steps)."""

import os
import subprocess
import sys

import pytest

from xla_flags import fake_devices

TESTS = os.path.dirname(os.path.abspath(__file__))
SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np
from hf_models import make_hf_checkpoint
import test_hybrid_host_tier as t
directory = make_hf_checkpoint(sys.argv[2] + "/qwen3_5", "qwen3_5")
rng = np.random.default_rng(5)
ids = lambda n: [int(x) for x in rng.integers(1, 250, n)]  # noqa: E731
docs = [ids(32) for _ in range(4)]
prompts = [(docs[i] if (r + i) % 3 else docs[i][:19]) + ids(5) for r in range(3) for i in rng.permutation(4)]
want = t.run(t.engine(directory, **{"engine.state_snapshot_tokens": 0}), prompts)
e = t.engine(directory, **t.TIER, **{"mesh.data": 2, "mesh.cpu_split": False})
got = t.run(e, prompts)
e.runner.kv_offload.flush()
st = e.stats()
assert got == want, (got, want)
assert st["host_state_snapshots_restored"] >= 1, st
assert min(st["requests_per_replica"]) >= 4, st
assert st["pages_free"] == st["pages_total"], st
print("OK")
"""


@pytest.mark.slow
def test_host_tier_snapshots_resume_on_both_replicas(tmp_path):
    env = dict(os.environ, XLA_FLAGS=fake_devices(2))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, TESTS, str(tmp_path)], cwd=os.path.dirname(TESTS), env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-4000:]
