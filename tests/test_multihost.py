"""Two processes x four CPU devices, jax.distributed on 127.0.0.1: generation sharded over
all 8 devices (tensor=2 x sequence=4, collectives crossing processes over gloo) returns
exactly the single-process tokens, through the model-level loop and through the Engine
(process 0 owns the scheduler and broadcasts each batch; process 1 follows), also with
one data replica per process, int8, a mixture of experts over mesh.expert, and
multi-head latent attention. Global
device ids are not contiguous across processes."""

from __future__ import annotations

import os
import sys

import pytest
from serving_util import free_port, run_process_pair
from xla_flags import fake_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "multihost_worker.py")
TIMEOUT_S = 420


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multihost")
    env = dict(os.environ, XLA_FLAGS=fake_devices(4), JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    port = free_port()
    outs = [tmp / f"out{i}.json" for i in range(2)]
    return run_process_pair(lambda i: [sys.executable, WORKER, str(i), "2", str(port), str(outs[i])], outs, env,
                            TIMEOUT_S, "multi-host workers")


@pytest.fixture(scope="module")
def reference():
    from multihost_worker import PROMPT, PROMPT2, reference_tokens

    return [reference_tokens(PROMPT), reference_tokens(PROMPT2)]


@pytest.mark.slow  # 247 s in a full run (2026-12-07, 2 loaded cores)
def test_two_processes_form_one_8_device_mesh(runs):
    for i, r in enumerate(runs):
        assert r["process_index"] == i and r["process_count"] == 2, r
        assert r["global_devices"] == 8 and r["local_devices"] == 4, r
    assert runs[0]["device_ids"] == runs[1]["device_ids"]


def test_model_level_generation_matches_single_process(runs, reference):
    assert len(set(reference[0])) > 1 and reference[0] != reference[1]
    for r in runs:
        assert r["model"] == reference[0]


@pytest.mark.parametrize("name", ["engine", "engine_dp"])
def test_engine_leader_generates_and_follower_runs_every_step(runs, reference, name):
    leader, follower = runs[0][name], runs[1][name]
    assert "error" not in leader, leader["error"]
    assert "error" not in follower, follower["error"]
    assert leader["tokens"] == reference[:len(leader["tokens"])]
    assert follower["steps_run"] == leader["steps_run"] > 0  # the same steps, in lockstep
    assert "process 0" in follower["refused"]  # a follower's add_request is refused, clearly
    assert leader["free"] == leader["total"]


def test_quantized_weights_and_kv_over_two_processes(runs):
    """int8 weights + int8 KV, tensor 2 x sequence 4 over two processes = one device."""
    from multihost_worker import quant_reference_tokens

    leader, follower = runs[0]["engine_quant"], runs[1]["engine_quant"]
    assert "error" not in leader, leader["error"]
    assert "error" not in follower, follower["error"]
    expected = quant_reference_tokens()
    assert len(set(expected)) > 1
    assert leader["tokens"] == [expected]
    assert follower["steps_run"] == leader["steps_run"] > 0 and leader["free"] == leader["total"]


def test_experts_split_over_two_processes(runs):
    """A MoE model, tensor 2 x expert 4 over two processes (tensor spans them, so the MoE
    layer's all-reduce over expert x tensor crosses processes over gloo) = one device."""
    from multihost_worker import MOE, quant_reference_tokens

    leader, follower = runs[0]["engine_moe"], runs[1]["engine_moe"]
    assert "error" not in leader, leader["error"]
    assert "error" not in follower, follower["error"]
    expected = quant_reference_tokens(MOE)
    assert len(set(expected)) > 1
    assert leader["tokens"] == [expected]
    assert follower["steps_run"] == leader["steps_run"] > 0 and leader["free"] == leader["total"]


def test_latent_attention_over_two_processes(runs):
    """DeepSeek V3's multi-head latent attention, tensor 2 x sequence 4 over two processes
    (the latent cache on every device, the heads split across the processes) = one device."""
    from multihost_worker import MLA, quant_reference_tokens

    leader, follower = runs[0]["engine_mla"], runs[1]["engine_mla"]
    assert "error" not in leader, leader["error"]
    assert "error" not in follower, follower["error"]
    expected = quant_reference_tokens(MLA)
    assert len(set(expected)) > 1
    assert leader["tokens"] == [expected]
    assert follower["steps_run"] == leader["steps_run"] > 0 and leader["free"] == leader["total"]


def test_data_replicas_split_over_processes(runs):
    assert runs[0]["engine_dp"]["per_replica"] == [1, 1]


def test_host_kv_tier_over_two_processes(runs):
    """Each process keeps its own host tier; process 0's saves and restores reach process 1
    as lockstep messages, and the restored pages (NaN-filled pool) give the tokens of one
    device without a tier."""
    from multihost_worker import tier_reference_tokens

    leader, follower = runs[0]["engine_tier"], runs[1]["engine_tier"]
    assert "error" not in leader and "error" not in follower, leader.get("error") or follower.get("error")
    assert leader["tokens"] == tier_reference_tokens()
    assert leader["host_kv_hit_tokens"] > 0 and sum(leader["cached"][3:]) > 0
    assert follower["steps_run"] == leader["steps_run"] and leader["free"] == leader["total"]
