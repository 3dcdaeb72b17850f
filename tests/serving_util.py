"""Helpers shared by the serving tests: JAX compile cache, metric parsing, subprocess servers."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CACHE_DIR: list[str] = []


def compile_cache_dir(tmp_path_factory) -> str:
    """One persistent XLA cache per test session, shared by the in-process server and the
    subprocess ones: the second server loads its programs instead of compiling (~10x).
    JAXFILL_TEST_COMPILE_CACHE=DIR keeps it across sessions."""
    if not _CACHE_DIR and os.environ.get("JAX_COMPILATION_CACHE_DIR"):  # tests/conftest.py sets it
        _CACHE_DIR.append(os.environ["JAX_COMPILATION_CACHE_DIR"])
    if not _CACHE_DIR:
        import jax

        d = os.environ.get("JAXFILL_TEST_COMPILE_CACHE") or str(tmp_path_factory.mktemp("jax_cache"))
        jax.config.update("jax_compilation_cache_dir", d)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        _CACHE_DIR.append(d)
    return _CACHE_DIR[0]


def run_process_pair(argv, outs: list, env: dict, timeout_s: float, what: str) -> list[dict]:
    """Starts `argv(i)` for processes 0 and 1 of one jax.distributed group together, waits
    for both and returns the JSON each wrote to outs[i]; a hang or a failed process fails
    the test with its log."""
    import json

    import pytest

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = [subprocess.Popen(argv(i), env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(2)]
    try:
        logs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"{what} did not finish in {timeout_s}s")
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{logs[i][-6000:]}"
    return [json.loads(o.read_text()) for o in outs]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (coordinators, servers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`jaxfill serve` in a subprocess on 127.0.0.1:0; learns its ports from the startup log."""

    def __init__(self, *extra: str, cache_dir: str | None = None, timeout: float = 300.0,
                 env: dict | None = None, listens: bool = True):
        """listens=False: a follower process of a multi-process run (it never opens a port)."""
        env = dict(os.environ, **(env or {}))
        if cache_dir:
            env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
            env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
            env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
        cmd = [sys.executable, "-m", "jaxfill.serving.cli", "serve", "--config", "tiny_random", "--host", "127.0.0.1",
               "--port", "0", *extra]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.lines: list[str] = []
        self.port = None
        self.metrics_port = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.time() + timeout
        while listens and self.port is None:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited early:\n" + "".join(self.lines))
            if time.time() > deadline:
                self.kill()
                raise TimeoutError("server never logged its address:\n" + "".join(self.lines))
            time.sleep(0.05)

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"listening on grpcs?://127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))
            m = re.search(r"metrics on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.metrics_port = int(m.group(1))

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return "".join(self.lines)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def scrape(port: int) -> dict:
    """{(name, labels tuple): value} from a Prometheus text endpoint."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out
