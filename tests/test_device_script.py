"""The device script (benchmarks/gpu_kernels.sh) rehearsed by its --dry-run on this CPU:
every part runs (set-up, the oracle tests, the kernel timings, the engine prefill and
decode) and leaves its results under $OUT, so a broken script is found here and not in
the minutes of a lent GPU. 1-2 minutes: the interpreted Pallas GPU kernel and the engine
part's step buckets (compiled; the compile cache is shared with later runs)."""

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # 124 s in a full run (2026-12-07, 2 loaded cores)
def test_dry_run_leaves_every_result(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(["bash", "benchmarks/gpu_kernels.sh", "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    suite = ET.parse(tmp_path / "oracle.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert int(suite.get("tests")) >= 1 and int(suite.get("failures")) == int(suite.get("errors")) == 0
    mosaic = ET.parse(tmp_path / "oracle_mosaic_gpu.xml").getroot()  # compiled cases: skip off Hopper
    mosaic = mosaic if mosaic.tag == "testsuite" else mosaic.find("testsuite")
    assert int(mosaic.get("tests")) >= 1 and int(mosaic.get("failures")) == int(mosaic.get("errors")) == 0
    attention = json.loads((tmp_path / "attention_gpu_dry_run.json").read_text())
    assert [c["case"] for c in attention["cases"]][:2] == ["prefill 256 tokens", "prefill 512 tokens"]
    assert all(r.get("ok") for c in attention["cases"] for i, r in c["impls"].items() if i == "xla")
    engine = json.loads((tmp_path / "engine_gpu_dry_run.json").read_text())
    assert [p["tokens"] for p in engine["prefill"]] == [64] and engine["prefill"][0]["ttft_s"] > 0
    assert engine["decode"]["new_tokens"] == engine["decode"]["seqs"] * 8
    assert "jax" in (tmp_path / "versions.txt").read_text()
