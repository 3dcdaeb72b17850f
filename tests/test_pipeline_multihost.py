"""Pipeline parallelism across processes (issue #16): two processes x 2 CPU devices,
jax.distributed on 127.0.0.1, mesh.stage=2 outermost, so each process holds one stage
(its layers, its KV pages, its half of the vocab) and activations cross processes by
collective permute. The Engine (process 0 schedules, process 1 follows) and `jaxfill
serve` give the single-process, single-device tokens, chunked prefill and prefix-cache
hits included."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
from serving_util import ServeProcess, compile_cache_dir, free_port, run_process_pair
from xla_flags import fake_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "pipeline_multihost_worker.py")
TIMEOUT_S = 420
ENV = {"XLA_FLAGS": fake_devices(2), "JAX_PLATFORMS": "cpu"}


def run_workers(tmp_path, axis: str) -> list[dict]:
    env = dict(os.environ, **ENV, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    port = free_port()
    outs = [tmp_path / f"out{i}.json" for i in range(2)]
    results = run_process_pair(lambda i: [sys.executable, WORKER, str(i), str(port), axis, str(outs[i])], outs,
                               env, TIMEOUT_S, "pipeline workers")
    for i, r in enumerate(results):
        assert "error" not in r, f"process {i}:\n{r['error']}"
    return results


@pytest.fixture(scope="module")
def reference():
    from pipeline_multihost_worker import reference_tokens

    tokens = reference_tokens()
    assert len({t for seq in tokens for t in seq}) > 2  # not a degenerate model
    return tokens


def stages_held(leaf: dict, mesh_sizes: dict) -> set[int]:
    """The 'stage' coordinates of a leaf's local shards: along a dim split over axes
    (a1, a2, ...), shard block b belongs to a1's coordinate b // (size a2 x ...) and so on."""
    held = set()
    for index in leaf["indices"]:
        for dim, axes in enumerate(leaf["spec"]):
            if "stage" not in axes:
                continue
            parts = 1
            for ax in axes:
                parts *= mesh_sizes[ax]
            block_len = leaf["shape"][dim] // parts
            start, stop = index[dim]
            assert stop - start == block_len, (leaf, index)
            inner = 1
            for ax in axes[axes.index("stage") + 1:]:
                inner *= mesh_sizes[ax]
            held.add((start // block_len) // inner % mesh_sizes["stage"])
    return held


def assert_one_stage_per_process(layout: dict, k: int, mesh_sizes: dict) -> None:
    """Every leaf split over 'stage' has, on process k, only stage k's part: index k of a
    stacked [stage, ...] leaf (layers, KV pages), stage k's vocab blocks of the embedding
    and LM head."""
    staged = {name: leaf for name, leaf in layout.items() if any("stage" in axes for axes in leaf["spec"])}
    assert staged, "no leaf is split over 'stage'"
    for name, leaf in staged.items():
        assert stages_held(leaf, mesh_sizes) == {k}, (name, k, leaf)


@pytest.mark.slow
@pytest.mark.parametrize("axis", ["tensor", "data"])
def test_two_processes_as_two_stages_match_one_device(tmp_path, reference, axis):
    """stage 2 x (tensor or data) 2: process k's two devices are stage k."""
    leader, follower = run_workers(tmp_path, axis)
    assert leader["tokens"] == reference
    assert leader["cached"][2] >= 16 and leader["cached"][3] >= 16  # round 2 hit the prefix cache
    assert follower["steps_run"] == leader["steps_run"] > 0  # the same steps, in lockstep
    for k, r in enumerate((leader, follower)):
        assert r["process_index"] == k and r["local_devices"] == 2
        assert r["mesh_stage_of_local"] == [k, k]
        assert any(leaf["spec"][:1] == [["stage"]] for leaf in r["params"].values())  # stacked layers
        assert any(["tensor", "stage"] in leaf["spec"] for leaf in r["params"].values())  # vocab split
        assert len(r["kv"]) == 2  # tiny_random: K = 4 layers / 2 stages entries, each [stage, ...]
        sizes = {"stage": 2, "tensor": 1, "data": 1, "sequence": 1, axis: 2}
        for layout in (r["params"], r["kv"]):
            assert_one_stage_per_process(layout, k, sizes)
            with pytest.raises(AssertionError):  # the check tells the stages apart
                assert_one_stage_per_process(layout, 1 - k, sizes)


@pytest.mark.slow
def test_serve_two_processes_as_two_stages_answers_grpc(tmp_path_factory, reference):
    """`jaxfill serve --num-processes 2 --set mesh.stage=2` (x tensor 2): process 0 serves
    gRPC and leads, process 1 follows; Generate returns the one-device tokens."""
    from jaxfill.serving.client import Client
    from pipeline_multihost_worker import ENGINE, MAX_TOKENS, ROUNDS

    cache = compile_cache_dir(tmp_path_factory)
    port = free_port()
    settings = {**ENGINE, "mesh.stage": 2, "mesh.tensor": 2}
    sets = [x for k, v in settings.items() for x in ("--set", f"{k}={json.dumps(v)}")]  # TOML literals

    def args(process_id: int) -> list[str]:
        return [*sets, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(process_id),
                "--grace-period", "30"]

    follower = ServeProcess(*args(1), cache_dir=cache, env=ENV, listens=False)
    leader = None
    try:
        leader = ServeProcess(*args(0), cache_dir=cache, env=ENV, timeout=TIMEOUT_S)
        with Client(leader.address) as client:
            deadline = time.time() + TIMEOUT_S
            while client.health() != 1:  # SERVING once process 0 led both through warm-up
                assert leader.proc.poll() is None and follower.proc.poll() is None, leader.log() + follower.log()
                assert time.time() < deadline, leader.log()
                time.sleep(0.1)
            results = [client.generate(p, timeout=300, max_tokens=MAX_TOKENS, temperature=0.0,
                                       ignore_eos=True) for prompts in ROUNDS for p in prompts]
        assert [r.token_ids for r in results] == reference
        assert results[2].complete.cached_tokens >= 16  # round 2 hit round 1's pages
        assert "following process 0" in follower.log() and "listening" not in follower.log()
    finally:
        for proc in (leader, follower):
            if proc is not None:
                proc.kill()
