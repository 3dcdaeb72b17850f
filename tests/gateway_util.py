"""The real `smg` gateway (PyPI `smg`, a Rust binary) in front of `jaxfill serve` workers,
for tests and benchmarks/gateway.py: start, wait until it routes, read worker state, kill."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request

import grpc

from serving_util import ServeProcess, free_port

# The worker config every gateway test runs: the trained tiny preset (configs/tiny holds
# the tokenizer.json the gateway loads), small pages pool so "all pages back" is visible.
WORKER_SETTINGS = ['engine.attention_impl="reference"',  # tests/fast_engine.py
                   "engine.num_pages=64", "engine.max_model_len=256", "engine.max_num_batched_tokens=64",
                   "engine.token_buckets=[16, 64]", "engine.max_num_seqs=4"]


def smg_binary() -> str | None:
    return shutil.which("smg")


def start_worker(cache_dir: str | None, *extra: str, env: dict | None = None) -> ServeProcess:
    args = ["--config", "tiny", "--metrics-port", "0"]
    for s in WORKER_SETTINGS:
        args += ["--set", s]
    worker = ServeProcess(*args, *extra, cache_dir=cache_dir, env=env)
    try:
        wait_until(lambda: worker_healthy(worker.address), 300, "the worker's warm-up", interval=0.2)
    except BaseException:
        worker.kill()
        raise
    return worker


def worker_healthy(address: str) -> bool:
    """The worker's vllm HealthCheck (false while it compiles its buckets)."""
    from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

    try:
        with grpc.insecure_channel(address) as channel:
            return vpb_grpc.VllmEngineStub(channel).HealthCheck(vpb.HealthCheckRequest(), timeout=5).healthy
    except grpc.RpcError:
        return False


class SmgProcess:
    """`smg launch` on 127.0.0.1 (HTTP and Prometheus) over gRPC workers; returns once
    /v1/models lists the workers' model, so requests route."""

    def __init__(self, worker_addresses: list[str], policy: str = "round_robin", *extra: str,
                 timeout: float = 60.0, prefill: list[str] = (), decode: list[str] = ()):
        """prefill / decode (instead of worker_addresses): `--pd-disaggregation` over those pools."""
        self.port, self.prometheus_port = free_port(), free_port()
        if prefill or decode:
            workers = ["--pd-disaggregation", *[a for p in prefill for a in ("--prefill", f"grpc://{p}")],
                       *[a for d in decode for a in ("--decode", f"grpc://{d}")]]
        else:
            workers = ["--worker-urls", *[f"grpc://{a}" for a in worker_addresses]]
        cmd = [smg_binary() or "smg", "launch", "--host", "127.0.0.1", "--port", str(self.port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.prometheus_port),
               *workers, "--policy", policy, "--log-level", "info", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.model = self._wait_for_model(timeout)

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def _wait_for_model(self, timeout: float) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("smg exited early:\n" + self.log())
            try:
                models = self.get("/v1/models").get("data") or []
                if models:
                    return models[0]["id"]
            except (OSError, urllib.error.URLError, ValueError):
                pass
            time.sleep(0.2)
        self.kill()
        raise TimeoutError("smg never listed a model:\n" + self.log())

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
            return json.loads(r.read().decode() or "{}")

    def log(self) -> str:
        return "".join(self.lines[-200:])

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def worker_load(address: str):
    """The worker's own vllm GetLoads: its SchedulerLoad (running, waiting, used tokens)."""
    from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

    with grpc.insecure_channel(address) as channel:
        return vpb_grpc.VllmEngineStub(channel).GetLoads(vpb.GetLoadsRequest(), timeout=10).loads[0]


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1):
    """Polls `predicate` until it returns a truthy value (returned) or `timeout` passes."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def kill_all(*procs):
    """Kills every process even when one kill raises (a test's teardown)."""
    errors = []
    for p in procs:
        try:
            if p is not None:
                p.kill()
        except Exception as e:  # noqa: BLE001 - keep killing the rest
            errors.append(e)
    if errors:
        raise errors[0]
