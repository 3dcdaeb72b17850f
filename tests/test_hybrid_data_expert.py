"""Linear-attention hybrids with MoE (Qwen3.5-MoE: Gated DeltaNet, here; Granite 4.0-H: Mamba2,
tests/test_hybrid_data_expert_mamba2.py) under mesh.data = 2 and mesh.expert = 2 give one device's greedy tokens and top-5 logprobs
(1e-4), one subprocess per model on 2 fake CPU devices.

Under data = 2 each replica owns its own state-slot pool (the cache's state rows split over
'data' like the pages), so the requests are pinned to replicas: both replicas hold state
at once; on replica 0 a request is aborted midway and a later one takes its slot (it must
start from zeros, not the aborted request's state); on replica 1 a request resumes a
state snapshot of another's 32-token prefix (a slot copy outside the data-parallel
forward, whose slot ids must be offset to replica 1's rows). The state and pages start
NaN-filled; every page and slot comes back to its replica. Under expert = 2 the experts split over the ranks and the state is replicated
over them.

Slow (~25-40 s on 2 CPU cores: a subprocess with 2 fake devices, whose three engines
each compile their step programs); one model per file so two workers share them."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hf_models import make_hf_checkpoint
from xla_flags import fake_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = """
import json, math, sys
import numpy as np
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
model_dir, layouts = sys.argv[1], json.loads(sys.argv[2])
base = {"engine.max_num_batched_tokens": 64, "engine.token_buckets": [64], "engine.num_pages": 24,
        "engine.max_model_len": 96, "engine.max_num_seqs": 2, "mesh.cpu_split": False,
        "engine.attention_impl": "reference", "engine.state_snapshot_tokens": 16,
        "engine.state_snapshot_slots": 8,  # a's snapshot at 32 outlives b's and x's on one device
        "engine.kv_fill_value": float("nan")}
rng = np.random.default_rng(7)
ids = lambda n: [int(t) for t in rng.integers(3, 500, n)]  # noqa: E731
a = ids(40)
prompts = {"a": a, "b": ids(24), "x": ids(30), "c": ids(20), "d": a[:32] + ids(6)}
# (replica under data = 2, max_tokens): b and x share replica 0, so c (added after x's
# abort, b still running) takes x's slot; d resumes a's snapshot on replica 1
plan = {"a": (1, 6), "b": (0, 14), "x": (0, 40), "c": (0, 6), "d": (1, 6)}
out = {}
for name, overrides in layouts.items():
    engine = Engine.from_config("tiny", model_path=model_dir, overrides={**base, **overrides}, progress=False)
    data = engine.config.mesh.data > 1
    got = {k: {"tokens": [], "top": []} for k in plan}
    cached = {}
    def add(k):
        engine.add_request(prompts[k], SamplingParams(max_tokens=plan[k][1], logprobs=5), request_id=k,
                           replica=plan[k][0] if data else None)
    def step():
        for o in engine.step():
            got[o.request_id]["tokens"] += o.new_token_ids
            got[o.request_id]["top"] += [[v for _, v in lp["top"]] for lp in (o.logprobs or [])]
            if o.num_cached_tokens is not None:
                cached[o.request_id] = o.num_cached_tokens
    for k in ("a", "b", "x"):
        add(k)
    while len(got["x"]["tokens"]) < 4:  # x is midway: prefilled, a few tokens decoded
        step()
    engine.abort("x")
    step()
    for k in ("c", "d"):
        add(k)
    while engine.has_unfinished():
        step()
    st = engine.stats()
    out[name] = {"got": {k: v for k, v in got.items() if k != "x"}, "cached": cached,
                 "pages_back": st["pages_free"] == st["pages_total"],
                 "slots_back": [len(s.free_slots) for s in engine.scheduler.replicas],
                 "per_replica": st["requests_per_replica"]}
print("RESULT " + json.dumps(out))
"""
LAYOUTS = {"one": {}, "data2": {"mesh.data": 2}, "expert2": {"mesh.expert": 2}}


@pytest.mark.slow
def test_gated_deltanet_moe_data_and_expert_match_one_device(tmp_path):
    check_data_and_expert(tmp_path, "qwen3_5_moe")


def check_data_and_expert(tmp_path, arch: str) -> None:
    """The layouts of LAYOUTS against one device, for the HF checkpoint `arch`."""
    directory = make_hf_checkpoint(str(tmp_path / arch), arch)
    env = dict(os.environ, XLA_FLAGS=fake_devices(2))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, directory, json.dumps(LAYOUTS)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    r = json.loads(lines[-1][len("RESULT "):])
    want = r["one"]["got"]
    assert len({tuple(v["tokens"]) for v in want.values()}) == 4
    for k, v in want.items():
        assert len(v["tokens"]) == {"a": 6, "b": 14, "c": 6, "d": 6}[k]
        assert np.isfinite(v["top"]).all(), k
    assert r["data2"]["per_replica"] == [3, 2]
    for name in ("data2", "expert2"):
        assert r[name]["pages_back"], name
        assert r[name]["slots_back"] == [2] * len(r[name]["slots_back"]), (name, r[name]["slots_back"])
        for k, v in r[name]["got"].items():
            assert v["tokens"] == want[k]["tokens"], (arch, name, k)
            np.testing.assert_allclose(v["top"], want[k]["top"], atol=1e-4, err_msg=f"{arch} {name} {k}")
    for name in r:  # d resumed a's snapshot of their 32 shared tokens
        assert r[name]["cached"]["d"] == 32, (name, r[name]["cached"])
