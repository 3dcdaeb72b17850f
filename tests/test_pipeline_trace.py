"""benchmarks/pipeline_trace.py: per-stage busy time from a synthetic XLA:CPU trace.

The trace is built by hand so every expected number is known: two stages, m = 2, three
ticks; stage 0 is useful in ticks 0-1, stage 1 in ticks 1-2; both devices' ops run on ONE
thread (as XLA:CPU may do), and each ppermute holds a nested rendezvous wait.
"""

import gzip
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from pipeline_trace import stage_profile  # noqa: E402


def _op(name, ts, dur, device=None, tid=7):
    args = {"device_ordinal": str(device)} if device is not None else {}
    return {"ph": "X", "pid": 1, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": args}


def _trace(tmp_path):
    events, t = [], 0.0
    # before the loop, device 0 only: the LM head gather (5 of it waiting) and its copy
    events += [_op("all-gather.1", t, 20, 0), _op("Rendezvous", t + 1, 5), _op("wrapped_copy.2", t + 20, 10, 0)]
    t = 30.0
    compute = {(0, 0): 100, (1, 0): 40, (0, 1): 110, (1, 1): 120, (0, 2): 30, (1, 2): 130}  # (device, tick)
    for tick in range(3):
        for dev in (0, 1):  # interleaved on one thread; a nested fusion must not count twice
            c = compute[(dev, tick)]
            events += [_op("while.3", t, c, dev), _op("ynn_fusion.4", t + 1, c - 2, dev)]
            t += c
        for dev in (0, 1):
            events += [_op("ppermute.5", t, 8, dev), _op("Rendezvous", t + 1, 6)]
            t += 8
    events.append(_op("ThunkExecutor::Execute (wait for completion)", 0, t, 0, tid=9))  # client thread
    path = tmp_path / "x.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return str(path)


def test_stage_profile_attributes_ticks_per_device(tmp_path):
    rows = stage_profile(_trace(tmp_path), stages=2, microbatches=2)
    assert [r["stage"] for r in rows] == [0, 1]
    s0, s1 = rows
    assert s0["pre_loop_gather_copy_us"] == pytest.approx(15 + 10)  # gather minus its wait, plus the copy
    assert s0["tick_compute_us"] == pytest.approx([100, 110, 30])
    assert s1["tick_compute_us"] == pytest.approx([40, 120, 130])
    assert s0["useful_us"] == pytest.approx(210) and s0["fill_drain_us"] == pytest.approx(30)
    assert s1["useful_us"] == pytest.approx(250) and s1["fill_drain_us"] == pytest.approx(40)
    assert s0["rendezvous_wait_us"] == pytest.approx(5 + 3 * 6)
    assert s1["rendezvous_wait_us"] == pytest.approx(3 * 6)
    assert s1["busy_us"] == pytest.approx(40 + 120 + 130 + 3 * 2)  # ppermute copy time counts as busy
    assert s0["bubble_profile"] == pytest.approx(1 - 210 / s0["window_us"])
