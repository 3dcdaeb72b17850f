"""Multi-host lockstep: process 0 owns the scheduler; every process runs its batches.

    leader (process 0)                       followers (processes 1 .. N-1)
    Runner.run(batch):                       Runner.follow():
      broadcast [RUN, bucket, batch] ----->    op, batch = receive()  (template of the bucket)
      step(...)   <-- collectives of the one sharded program -->   step(...)
    Runner.close(): [STOP]            ----->    return

Each message is one broadcast in the manner of multihost_utils.broadcast_one_to_all (a
psum over every device of every process, process 0 alone contributing), so nothing
but JAX's own runtime carries the batch. A follower cannot know the next bucket, so the
first broadcast has one fixed size, FIRST_WORDS int32 words: [op, bucket, payload words,
the payload's start]. A payload that does not fit goes in a second broadcast, its size
rounded up to a power of two (few compiled programs). The payload is the batch's leaves
as int32 words with each row's trailing run of one value (padding: null pages, empty
penalty history, padding tokens) cut to one word, so it grows with the live content,
not with the bucket: a decode step is one small broadcast where sizing for the largest
bucket sent ~2 MiB for llama3_1_8b (page_indices [64, 8192] alone). While the leader is
idle it sends a HEARTBEAT now and then, so no follower sits in one collective for longer
than the collective backend's timeout.

Single process: no Lockstep at all (Runner.lockstep is None).
"""

from __future__ import annotations

import time

import numpy as np

from jaxfill.engine.batch import StepBatch

RUN, STOP, HEARTBEAT, RESET, USE_XLA = 1, 2, 3, 4, 5
KV_SAVE, KV_RESTORE, KV_WARMUP = 6, 7, 8  # the host KV tier's programs (engine/kv_tier/page_offload.py): int32 words
# Engine.update_weights / sleep / wake (engine/weights_lockstep.py): a checkpoint path or a level as words
WEIGHTS_LOAD, WEIGHTS_SWAP, WEIGHTS_DROP, SLEEP, WAKE = 9, 10, 11, 12, 13
WEIGHT_OPS = (WEIGHTS_LOAD, WEIGHTS_SWAP, WEIGHTS_DROP, SLEEP, WAKE)
KV_EXPORT, KV_IMPORT = 14, 15  # disaggregated prefill's gather and scatter (engine/disagg/runner_side.py)
WORD_OPS = (KV_SAVE, KV_RESTORE, WEIGHTS_LOAD, SLEEP, KV_EXPORT, KV_IMPORT)
HEARTBEAT_S = 5.0
HEADER = 3  # op, bucket, payload words
FIRST_WORDS = 8192  # 32 KiB: a decode of 64 sequences x 100 pages (no penalties) fits in one broadcast
MIN_REST_WORDS = 1024


class Lockstep:
    def __init__(self, templates: list[StepBatch], broadcast=None):
        """templates[i]: a batch of bucket i's shape (stacked when data > 1): what followers
        unpack into. Leader and followers must build the same list. `broadcast(buf) -> buf`
        (tests): what process 0's buffer becomes everywhere; default a sum over processes."""
        import jax

        self.templates = templates
        self.index = {self._key(b): i for i, b in enumerate(templates)}
        self.max_rest = max(max_payload_words(b) for b in templates) - (FIRST_WORDS - HEADER)
        self.is_leader = jax.process_index() == 0
        self._rows, self._sum = _sum_over_processes()
        self.last_sent = time.monotonic()
        self.stopped = False
        self.num_sent = 0  # messages sent (leader): benchmarks/multihost.py reads these
        self.send_s = 0.0  # seconds spent broadcasting
        self.words_sent = 0  # int32 words broadcast (leader), both parts of every message
        self._broadcast = broadcast or self._broadcast_over_processes

    @staticmethod
    def _key(batch: StepBatch) -> tuple:
        return tuple(batch.tokens.shape) + tuple(batch.meta.kv_lens.shape)

    def _broadcast_over_processes(self, buf: np.ndarray) -> np.ndarray:  # [size] int32
        import jax

        local = (buf if self.is_leader else np.zeros_like(buf))[None]  # only process 0 contributes
        total = self._sum(jax.make_array_from_process_local_data(self._rows, local))
        return np.asarray(total.addressable_data(0))

    # ------------------------------------------------------------------ leader
    def send(self, op: int, batch: StepBatch | None = None, words: np.ndarray | None = None) -> None:
        """[op, bucket, n, the first words of pack(batch) (or of `words`, for WORD_OPS)],
        then the rest if any."""
        if not self.is_leader:
            raise RuntimeError("only process 0 sends batches")
        if self.stopped:
            raise RuntimeError("the followers were released (close() was called)")
        start = time.perf_counter()
        if words is None:
            words = pack(batch) if batch is not None else np.zeros(0, np.int32)
        first = np.zeros(FIRST_WORDS, np.int32)
        first[:HEADER] = op, self.index[self._key(batch)] if batch is not None else 0, words.size
        inline = min(words.size, FIRST_WORDS - HEADER)
        first[HEADER:HEADER + inline] = words[:inline]
        self._broadcast(first)
        self.words_sent += first.size
        if words.size > inline:
            rest = np.zeros(rest_words(words.size - inline, self.max_rest), np.int32)
            rest[:words.size - inline] = words[inline:]
            self._broadcast(rest)
            self.words_sent += rest.size
        self.send_s += time.perf_counter() - start
        self.num_sent += 1
        self.last_sent = time.monotonic()
        self.stopped = op == STOP

    def agree(self, ok: bool) -> bool:
        """Every process says whether it succeeded (a collective all of them call at the same
        point of the stream); True only if all did. One buffer of the first message's size,
        so the sum's program is the one already compiled."""
        buf = np.zeros(FIRST_WORDS, np.int32)
        buf[0] = 0 if ok else 1
        if self._broadcast != self._broadcast_over_processes:  # tests: one process stands for all
            return bool(ok)
        import jax

        total = self._sum(jax.make_array_from_process_local_data(self._rows, buf[None]))
        return int(np.asarray(total.addressable_data(0))[0]) == 0

    def heartbeat(self) -> None:
        if not self.stopped and time.monotonic() - self.last_sent >= HEARTBEAT_S:
            self.send(HEARTBEAT)

    # ------------------------------------------------------------------ followers
    def receive(self) -> tuple[int, StepBatch | np.ndarray | None]:
        """Blocks until the leader sends: (op, the batch for RUN, the words for WORD_OPS,
        else None)."""
        first = self._broadcast(np.zeros(FIRST_WORDS, np.int32))
        op, bucket, n = (int(x) for x in first[:HEADER])
        if op != RUN and op not in WORD_OPS:
            return op, None
        words = first[HEADER:HEADER + n]
        if n > words.size:
            rest = self._broadcast(np.zeros(rest_words(n - words.size, self.max_rest), np.int32))
            words = np.concatenate([words, rest[:n - words.size]])
        return op, (unpack(words, self.templates[bucket]) if op == RUN else words)


def rest_words(n: int, most: int) -> int:
    """Size of the second broadcast for n words: a power of two (few programs compile),
    capped at `most`, the largest any bucket can need."""
    return min(max(MIN_REST_WORDS, 1 << (n - 1).bit_length()), max(most, n))


def max_payload_words(template: StepBatch) -> int:
    """pack()'s worst case for a bucket: every row kept whole, plus one length per row."""
    import jax

    return sum(_as_rows(x).shape[0] + x.size for x in jax.tree.leaves(template))


def message_words(batch: StepBatch, templates: list[StepBatch]) -> int:
    """int32 words one RUN message of this batch broadcasts (both parts), with these buckets."""
    n = pack(batch).size
    extra = n - (FIRST_WORDS - HEADER)
    most = max(max_payload_words(b) for b in templates) - (FIRST_WORDS - HEADER)
    return FIRST_WORDS + (rest_words(extra, most) if extra > 0 else 0)


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


def _as_rows(x: np.ndarray) -> np.ndarray:  # [rows, last dim] int32 words
    """4-byte dtypes bit for bit, bools as 0/1; rows along the last axis."""
    x = np.ascontiguousarray(x)
    w = x.view(np.int32) if x.dtype.itemsize == 4 else x.astype(np.int32)
    return w.reshape(-1, x.shape[-1]) if x.ndim else w.reshape(1, 1)


def _kept(rows: np.ndarray,  # [n, w] int32
          ) -> np.ndarray:  # [n] int32: words kept per row, the trailing run of its last value cut to one
    n, w = rows.shape
    if w == 0:
        return np.zeros(n, np.int32)
    differs_reversed = np.ascontiguousarray((rows != rows[:, -1:])[:, ::-1])  # argmax is slow on a view
    return np.where(differs_reversed.any(axis=1), w + 1 - np.argmax(differs_reversed, axis=1), 1).astype(np.int32)


def pack(batch: StepBatch) -> np.ndarray:  # [words] int32
    """Per leaf, in tree order: each row's kept length, then the kept words of every row."""
    import jax

    parts = []
    for x in jax.tree.leaves(batch):
        rows = _as_rows(x)
        keep = _kept(rows)
        parts.append(keep)
        parts += [row[:k] for row, k in zip(rows, keep.tolist())]  # rows <= R * S: a short loop
    return np.concatenate(parts)


def unpack(words: np.ndarray,  # [pack(batch).size] int32
           template: StepBatch) -> StepBatch:
    """pack's inverse: leaves of the template's shapes and dtypes, bit for bit."""
    import jax

    leaves, treedef = jax.tree.flatten(template)
    out, at = [], 0
    for t in leaves:
        n, w = _as_rows(t).shape
        keep = words[at:at + n]
        at += n
        if keep.size != n or (w and ((keep < 1) | (keep > w)).any()):
            raise ValueError(f"lockstep message does not fit the bucket's template at word {at}")
        if words.size < at + int(keep.sum()):
            raise ValueError("lockstep message is shorter than its template needs")
        rows = np.empty((n, w), np.int32)
        for row, k in zip(rows, keep.tolist()):
            row[:k] = words[at:at + k]
            row[k:] = words[at + k - 1] if k else 0
            at += k
        x = rows.view(t.dtype) if t.dtype.itemsize == 4 else rows.astype(t.dtype)
        out.append(x.reshape(t.shape))
    if at != words.size:
        raise ValueError(f"lockstep message has {words.size - at} words past the template")
    return jax.tree.unflatten(treedef, out)
