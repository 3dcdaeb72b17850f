"""update_weights, sleep and wake over two processes (jax.distributed on 127.0.0.1,
mesh.tensor = 2 across them, one CPU device each): process 0 announces, every process
loads its own shards; the tokens equal a single-process engine's on each checkpoint, a
path no process can read is refused with nothing changed, and nothing compiles."""

from __future__ import annotations

import os
import sys

import pytest
from serving_util import free_port, run_process_pair
from xla_flags import fake_devices

from fast_engine import REFERENCE_ATTENTION
from update_weights_multihost_worker import OVER, PROMPTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "update_weights_multihost_worker.py")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from hf_models import make_hf_checkpoint

    root = tmp_path_factory.mktemp("update_multihost")
    return [make_hf_checkpoint(str(root / f"seed{s}"), "llama", seed=s) for s in (0, 1)]


@pytest.fixture(scope="module")
def runs(ckpts, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("update_multihost_out")
    env = dict(os.environ, XLA_FLAGS=fake_devices(1), JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    port = free_port()
    outs = [tmp / f"out{i}.json" for i in range(2)]
    return run_process_pair(lambda i: [sys.executable, WORKER, str(i), str(port), str(outs[i]), *ckpts], outs, env,
                            420, "update_weights workers")


@pytest.fixture(scope="module")
def single(ckpts):
    """Each checkpoint's tokens from a single-process, one-device engine."""
    from jaxfill import Engine, SamplingParams
    from jaxfill.engine.config import load_config

    assert OVER["engine.attention_impl"] == REFERENCE_ATTENTION["engine.attention_impl"]
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    return [[c.token_ids for c in Engine(load_config("tiny_random", OVER, p), progress=False).generate(PROMPTS, greedy)]
            for p in ckpts]


@pytest.mark.slow
def test_multi_process_update_equals_single_process(runs, single):
    leader, follower = runs
    assert "error" not in leader, leader["error"]
    assert "error" not in follower, follower["error"]
    assert single[0] != single[1]
    assert leader["a"] == single[0] and leader["b"] == single[1]
    assert "is not a checkpoint directory" in leader["refused"] and leader["b_after_refusal"] == single[1]
    assert leader["b_after_wake"] == single[1] and leader["a_again"] == single[0]
    assert leader["compiled"] == 0
    assert follower["steps"] == leader["steps"]  # every step, in lockstep


@pytest.mark.slow
def test_multi_process_sleep_frees_each_process_share(runs):
    leader = runs[0]
    assert leader["asleep_bytes"] < 1024 and leader["freed"] == leader["device_bytes"] - leader["asleep_bytes"]
    assert leader["woken_bytes"] == leader["device_bytes"]
