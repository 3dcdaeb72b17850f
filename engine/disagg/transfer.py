"""A request's prompt KV moved between two engines by JAX's transfer server: the rows
of engine/kv_rows.py, offered by the prefill side and pulled by the decode side.

`jax.experimental.transfer` (jax 0.10.2, CPU) as measured: `await_pull` returns
nothing and never says when a pull happened (so the decode side says so, serving/
disagg.py); with `timeout` (a datetime) a later pull of that id is not served; `pull`
returns at once with arrays that become ready when the bytes arrive, and a pull of an
id nobody offers never becomes ready (its own `timeout` did not fire), so `wait_ready`
polls `is_ready()` against our own deadline.
"""

from __future__ import annotations

import datetime
import threading
import time
import uuid as uuidlib

import jax
import jax.numpy as jnp


class TransferFailed(RuntimeError):
    """A pull did not arrive in time, or its layout does not fit this engine."""


def wait_ready(arrays, deadline: float, poll_s: float = 0.002) -> bool:
    """Polls until every array has arrived or time.monotonic() passes deadline."""
    while not all(a.is_ready() for a in arrays):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


class TransferAgent:
    """This process's transfer server: offers rows under fresh ids, pulls others' rows."""

    def __init__(self, host: str = "127.0.0.1"):
        from jax.experimental import transfer

        client = jax.local_devices()[0].client
        self.server = transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"])
        self.address = self.server.address()
        self._conns: dict[str, object] = {}
        self._lock = threading.Lock()

    def offer(self, arrays: list, timeout_s: float) -> int:
        """Offers arrays for one pull within timeout_s (the server drops them after: a late
        pull never arrives); returns the transfer id (a 63-bit int)."""
        tid = uuidlib.uuid4().int >> 65
        until = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        self.server.await_pull(tid, list(arrays), timeout=until)
        return tid

    def pull(self, address: str, tid: int, specs: list[tuple[tuple[int, ...], str]]) -> list:
        """Starts pulling; the arrays become ready when the bytes arrive (see wait_ready)."""
        with self._lock:
            conn = self._conns.get(address)
            if conn is None:
                conn = self._conns[address] = self.server.connect(address)
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return conn.pull(tid, [jax.ShapeDtypeStruct(tuple(s), jnp.dtype(d), sharding=sharding) for s, d in specs])
