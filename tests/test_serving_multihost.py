"""`jaxfill serve` as two processes (jax.distributed on 127.0.0.1, 2 CPU devices each,
one data replica per process x tensor 2): process 0 owns the gRPC endpoint and the
scheduler, process 1 follows its broadcast batches. Concurrent streams return the
single-process tokens; SIGTERM on process 0 drains it and releases process 1; both exit 0."""

from __future__ import annotations

import concurrent.futures
import signal
import time

import pytest

from jaxfill.serving.client import Client
from serving_util import ServeProcess, compile_cache_dir, free_port
from xla_flags import fake_devices
from fast_engine import REFERENCE_ATTENTION

ENGINE = {**REFERENCE_ATTENTION,  # tests/fast_engine.py
          "engine.max_num_batched_tokens": 32, "engine.max_num_seqs": 4, "engine.num_pages": 64,
          "engine.max_model_len": 256}
MESH = {"mesh.data": 2, "mesh.tensor": 2}
PROMPTS = [[5, 6, 7, 8, 9], [(7 * i + 3) % 250 for i in range(40)], [11, 12], [(5 * i) % 200 for i in range(19)]]
SAMPLING = [dict(max_tokens=8, temperature=0.0), dict(max_tokens=6, temperature=0.8, seed=7),
            dict(max_tokens=5, temperature=0.0), dict(max_tokens=9, temperature=1.0, top_k=20, seed=1)]


def _args(process_id: int, port: int) -> list[str]:
    sets = [x for k, v in {**ENGINE, **MESH}.items() for x in ("--set", f"{k}={v}")]
    return [*sets, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(process_id),
            "--grace-period", "30"]


@pytest.fixture(scope="module")
def reference():
    from jaxfill.engine.engine import Engine
    from jaxfill.engine.request import SamplingParams

    engine = Engine.from_config("tiny_random", overrides=ENGINE, progress=False)
    return [c.token_ids for c in engine.generate(PROMPTS, [SamplingParams(**s) for s in SAMPLING])]


@pytest.mark.slow
def test_two_process_server_matches_one_process_and_stops_cleanly(tmp_path_factory, reference):
    cache = compile_cache_dir(tmp_path_factory)
    port = free_port()
    env = {"XLA_FLAGS": fake_devices(2), "JAX_PLATFORMS": "cpu"}
    follower = ServeProcess(*_args(1, port), cache_dir=cache, env=env, listens=False)
    leader = None
    try:
        leader = ServeProcess(*_args(0, port), cache_dir=cache, env=env, timeout=400)
        with Client(leader.address) as client:
            deadline = time.time() + 400
            while client.health() != 1:  # SERVING once process 0 led both through warm-up
                assert leader.proc.poll() is None and follower.proc.poll() is None, leader.log() + follower.log()
                assert time.time() < deadline, leader.log()
                time.sleep(0.1)
            with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
                futures = [pool.submit(client.generate, p, timeout=300, **s) for p, s in zip(PROMPTS, SAMPLING)]
                results = [f.result() for f in futures]
            info = client.model_info()
        assert [r.token_ids for r in results] == reference
        assert info.pages_free == info.pages_total == 2 * (ENGINE["engine.num_pages"] - 1)
        assert "following process 0" in follower.log() and "listening" not in follower.log()

        leader.proc.send_signal(signal.SIGTERM)
        assert leader.proc.wait(120) == 0, leader.log()
        assert follower.proc.wait(120) == 0, follower.log()
        assert "process 0 closed" in follower.log(), follower.log()
    finally:
        for proc in (leader, follower):
            if proc is not None:
                proc.kill()
