"""Multi-host lockstep: process 0 owns the scheduler; every process runs its batches.

    leader (process 0)                       followers (processes 1 .. N-1)
    Runner.run(batch):                       Runner.follow():
      broadcast [RUN, bucket, batch] ----->    op, batch = receive()  (template of the bucket)
      step(...)   <-- collectives of the one sharded program -->   step(...)
    Runner.close(): [STOP]            ----->    return

Each message is one broadcast in the manner of multihost_utils.broadcast_one_to_all (a
psum over every device of every process, process 0 alone contributing), so nothing
but JAX's own runtime carries the batch. It
is one fixed-size int32 buffer, [op, bucket, the batch's leaves packed as int32 words,
padding], sized for the largest bucket: a follower can wait for it without knowing the
next bucket, it is one collective per step (a pytree of 20 leaves would be 20), and
one compiled program. While the leader is idle it sends a HEARTBEAT now and then, so no
follower sits in one collective for longer than the collective backend's timeout.

Single process: no Lockstep at all (Runner.lockstep is None).
"""

from __future__ import annotations

import time

import numpy as np

from jaxfill.engine.batch import StepBatch

RUN, STOP, HEARTBEAT, RESET, USE_XLA = 1, 2, 3, 4, 5
HEARTBEAT_S = 5.0


class Lockstep:
    def __init__(self, templates: list[StepBatch]):
        """templates[i]: a batch of bucket i's shape (stacked when data > 1): what followers
        unpack into. Leader and followers must build the same list."""
        import jax

        self.templates = templates
        self.index = {self._key(b): i for i, b in enumerate(templates)}
        self.size = 2 + max(sum(x.size for x in jax.tree.leaves(b)) for b in templates)
        self.is_leader = jax.process_index() == 0
        self._rows, self._sum = _sum_over_processes()
        self.last_sent = time.monotonic()
        self.stopped = False
        self.num_sent = 0  # messages sent (leader): benchmarks/multihost.py reads these
        self.send_s = 0.0  # seconds spent broadcasting

    @staticmethod
    def _key(batch: StepBatch) -> tuple:
        return tuple(batch.tokens.shape) + tuple(batch.meta.kv_lens.shape)

    def _broadcast(self, buf: np.ndarray) -> np.ndarray:  # [size] int32
        import jax

        local = (buf if self.is_leader else np.zeros_like(buf))[None]  # only process 0 contributes
        total = self._sum(jax.make_array_from_process_local_data(self._rows, local))
        return np.asarray(total.addressable_data(0))

    # ------------------------------------------------------------------ leader
    def send(self, op: int, batch: StepBatch | None = None) -> None:
        """One message: [op, bucket, the batch's leaves as int32 words, zero padding]."""
        if not self.is_leader:
            raise RuntimeError("only process 0 sends batches")
        if self.stopped:
            raise RuntimeError("the followers were released (close() was called)")
        start = time.perf_counter()
        buf = np.zeros(self.size, np.int32)
        buf[0] = op
        if batch is not None:
            buf[1] = self.index[self._key(batch)]
            words = pack(batch)
            buf[2:2 + words.size] = words
        self._broadcast(buf)
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
        buf = self._broadcast(np.zeros(self.size, np.int32))
        op = int(buf[0])
        if op != RUN:
            return op, None
        return op, unpack(buf[2:], self.templates[int(buf[1])])


def _sum_over_processes():
    """multihost_utils.broadcast_one_to_all's psum with its mesh and jit built once (it
    builds a fresh jax.jit per call: about 1.5 ms of dispatch a step on CPU).
    Returns (sharding of the [processes, size] input, the jitted sum over processes)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxfill.engine.mesh import ordered_devices

    devices = np.array(ordered_devices()).reshape(jax.process_count(), jax.local_device_count())
    mesh = Mesh(devices, ("processes", "local"))
    total = jax.jit(lambda x: jnp.sum(x, axis=0, dtype=x.dtype), out_shardings=NamedSharding(mesh, PartitionSpec()))
    return NamedSharding(mesh, PartitionSpec("processes")), total


def pack(batch: StepBatch) -> np.ndarray:  # [words] int32
    """Every leaf as int32 words (4-byte dtypes bit for bit, bools as 0/1), in tree order."""
    import jax

    parts = []
    for x in jax.tree.leaves(batch):
        x = np.ascontiguousarray(x).reshape(-1)
        parts.append(x.view(np.int32) if x.dtype.itemsize == 4 else x.astype(np.int32))
    return np.concatenate(parts)


def unpack(words: np.ndarray,  # [>= words of template] int32
           template: StepBatch) -> StepBatch:
    import jax

    leaves, treedef = jax.tree.flatten(template)
    out, at = [], 0
    for t in leaves:
        chunk = words[at:at + t.size]
        at += t.size
        x = chunk.view(t.dtype) if t.dtype.itemsize == 4 else chunk.astype(t.dtype)
        out.append(x.reshape(t.shape).copy())
    return jax.tree.unflatten(treedef, out)
