"""Multi-host lockstep: process 0 owns the scheduler; every process runs its batches.

    leader (process 0)                       followers (processes 1 .. N-1)
    Runner.run(batch):                       Runner.follow():
      broadcast header [RUN, bucket] ----->    header = receive()
      broadcast batch                ----->    batch = receive(template of that bucket)
      step(...)   <-- collectives of the one sharded program -->   step(...)
    Runner.close(): header [STOP]    ----->    return

Broadcasts are jax.experimental.multihost_utils.broadcast_one_to_all (a psum over every
device of every process), so nothing but JAX's own runtime carries the batch. The header
has a fixed shape, so a follower can wait for it without knowing the next bucket; each
bucket's batch broadcast compiles once, during warm-up. While the leader is idle it
sends a HEARTBEAT now and then, so no follower sits in one collective for longer than
the collective backend's timeout.

Single process: no Lockstep at all (Runner.lockstep is None).
"""

from __future__ import annotations

import time

import numpy as np

from engine.batch import StepBatch

RUN, STOP, HEARTBEAT, RESET = 1, 2, 3, 4
HEARTBEAT_S = 5.0


class Lockstep:
    def __init__(self, templates: list[StepBatch]):
        """templates[i]: a batch of bucket i's shape (stacked when data > 1): what followers
        receive into. Leader and followers must build the same list."""
        import jax

        self.templates = templates
        self.index = {self._key(b): i for i, b in enumerate(templates)}
        self.is_leader = jax.process_index() == 0
        self.last_sent = time.monotonic()
        self.stopped = False
        self.num_sent = 0  # headers sent (leader): benchmarks/multihost.py reads these
        self.send_s = 0.0  # seconds spent broadcasting

    @staticmethod
    def _key(batch: StepBatch) -> tuple:
        return tuple(batch.tokens.shape) + tuple(batch.meta.kv_lens.shape)

    @staticmethod
    def _broadcast(tree):
        from jax.experimental import multihost_utils

        return multihost_utils.broadcast_one_to_all(tree)

    # ------------------------------------------------------------------ leader
    def send(self, op: int, batch: StepBatch | None = None) -> None:
        if not self.is_leader:
            raise RuntimeError("only process 0 sends batches")
        if self.stopped:
            raise RuntimeError("the followers were released (close() was called)")
        start = time.perf_counter()
        bucket = self.index[self._key(batch)] if batch is not None else -1
        self._broadcast(np.asarray([op, bucket], np.int32))
        if batch is not None:
            self._broadcast(batch)
        self.send_s += time.perf_counter() - start
        self.num_sent += 1
        self.last_sent = time.monotonic()
        self.stopped = op == STOP

    def heartbeat(self) -> None:
        if not self.stopped and time.monotonic() - self.last_sent >= HEARTBEAT_S:
            self.send(HEARTBEAT)

    # ------------------------------------------------------------------ followers
    def receive(self) -> tuple[int, StepBatch | None]:
        """Blocks until the leader sends: (op, batch for RUN else None)."""
        op, bucket = (int(x) for x in self._broadcast(np.zeros(2, np.int32)))
        if op != RUN:
            return op, None
        batch = self._broadcast(self.templates[bucket])
        return op, batch
