"""Disaggregated prefill with a multi-process engine on either side: an engine over two
processes (jax.distributed on 127.0.0.1, one CPU device each, mesh.data = 2, so each
replica's pages live on its own process) decodes what a one-process engine prefilled,
then prefills for it. Process 0 alone talks to the other engine; process 1 runs each
export and import with it (KV_EXPORT / KV_IMPORT, engine/disagg/runner_side.py). Pages
start NaN, so rows gathered from or written to the wrong place give other tokens. Every
continuation must equal the one-process engine doing the whole request itself, and every
page must come back. tests/disagg_multihost_worker.py is the processes' code."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from serving_util import free_port
from xla_flags import fake_devices
from disagg_multihost_worker import PREFIX

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "disagg_multihost_worker.py")
TIMEOUT_S = 300


def _start(args, env, log):
    return subprocess.Popen([sys.executable, WORKER, *args], env=env, cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=log, text=True)


def _hear(proc, logs):
    """The worker's next message (other lines on its stdout, e.g. gloo's, skipped)."""
    for line in proc.stdout:
        if line.startswith(PREFIX):
            return json.loads(line[len(PREFIX):])
    proc.wait(30)
    pytest.fail(f"a worker exited with {proc.returncode}:\n" + "\n".join(p.read_text()[-3000:] for p in logs))


def _say(proc, msg):
    proc.stdin.write(json.dumps(msg) + "\n")
    proc.stdin.flush()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disagg_multihost")
    env = dict(os.environ, XLA_FLAGS=fake_devices(1), JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    port = free_port()
    logs = [tmp / f"{name}.log" for name in ("single", "multi0", "multi1")]
    files = [open(p, "w") for p in logs]
    procs = [_start(["single"], env, files[0]), _start(["multi", "0", str(port)], env, files[1]),
             _start(["multi", "1", str(port)], env, files[2])]
    single, leader, follower = procs
    try:
        first = _hear(single, logs)  # its reference tokens and its offers
        _say(leader, first["offers"])
        decoded = _hear(leader, logs)  # what it decoded, and its own offers
        _say(single, decoded["offers"])
        back = _hear(single, logs)
        _say(leader, "pulled")
        last = _hear(leader, logs)
        for p in procs:
            p.stdin.close()
            assert p.wait(TIMEOUT_S) == 0, "\n".join(x.read_text()[-3000:] for x in logs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for f in files:
            f.close()
    return {"want": first["want"], "multi_decoded": decoded, "single_decoded": back, "multi_released": last}


@pytest.mark.slow
def test_two_process_decode_worker_equals_one_engine(run):
    assert len({tuple(t) for t in run["want"]}) == 4
    got = run["multi_decoded"]
    assert got["tokens"] == run["want"]
    assert sorted(got["replicas"]) == [0, 0, 1, 1]  # pulled rows went to both processes' pools
    assert all(run["single_decoded"]["released"]) and run["single_decoded"]["free"]


@pytest.mark.slow
def test_two_process_prefill_worker_equals_one_engine(run):
    assert sorted(run["multi_decoded"]["prefill_replicas"]) == [0, 0, 1, 1]  # exported from both processes
    assert run["single_decoded"]["tokens"] == run["want"]
    assert all(run["multi_released"]["released"]) and run["multi_released"]["free"]
