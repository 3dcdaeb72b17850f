"""The prefix cache's disk tier: blocks pushed out of the host tier, kept as files.

One file per block, `<hash hex>.kvb` in `engine.disk_kv_cache_dir` (the format:
engine/kv_tier/disk_format.py): the engine's fingerprint (model, weights, dtype, page size,
layout), the block's parent hash and tokens, its arrays and a checksum. A linear-attention
hybrid's state snapshots leave the host tier the same way, one file each named by its
snapshot key (its page's hash + b"state"), in the same index, budget and LRU as the
blocks; a snapshot is looked up only at the end of a prefix whose pages are all cached
in some tier (engine/scheduler/prefix_lookup.py), so it is never used without them.

A restarted engine with the same fingerprint indexes the files it finds and serves them;
files of another fingerprint are left alone (another engine may own them) with one log
line. A file that is short, unreadable, fails its checksum or holds the other kind (a
block under a snapshot's name) is deleted when read and counts as a miss: never served.

Writes run on one background thread through a queue bounded in bytes (by default the
host tier's budget, so blocks waiting for the disk at most double the host memory used),
so the stepping thread never waits on the disk; past the bound a block is dropped
(counted). Reads happen on the stepping thread at admission, one file per page hit (and
one for the snapshot). LRU within `engine.disk_kv_cache_gb` (a restart orders old files by
modification time).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
from collections import OrderedDict

from jaxfill.engine.kv_tier.disk_format import decode, encode, fingerprint, read_header  # noqa: F401 (re-exported)
from jaxfill.engine.kv_tier.host import KVBlock, StateSnapshot, TierCounts, is_snapshot_key

log = logging.getLogger("jaxfill.kv_tier")


class DiskKVTier:
    def __init__(self, directory: str, budget_bytes: int, fp: str, max_queued_bytes: int = 1 << 28):
        self.directory = directory
        self.budget_bytes = int(budget_bytes)
        self.fp = fp
        self.max_queued_bytes = int(max_queued_bytes)
        self.queued_bytes = 0  # blocks handed to the writer thread and not yet written
        self.counts = TierCounts()
        self.corrupt = 0  # files refused on read (short, unreadable, checksum)
        self.index: OrderedDict[bytes, int] = OrderedDict()  # hash (or snapshot key) -> file bytes, LRU first
        self.nbytes = 0
        self.num_snapshots = 0  # snapshot keys in the index
        self.snapshot_hits = 0  # snapshots read back whole (engine/kv_tier/host.py get_snapshot)
        self._lock = threading.Lock()  # index and nbytes: the writer thread adds, the stepper reads
        self._queue: queue.Queue = queue.Queue()
        os.makedirs(directory, exist_ok=True)
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="jaxfill-disk-kv", daemon=True)
        self._writer.start()

    def _path(self, h: bytes) -> str:
        return os.path.join(self.directory, h.hex() + ".kvb")

    def _scan(self) -> None:
        """Indexes this fingerprint's files, oldest first; the others are left alone."""
        found, others = [], 0
        for name in os.listdir(self.directory):
            if not name.endswith(".kvb"):
                continue
            path = os.path.join(self.directory, name)
            try:
                with open(path, "rb") as f:
                    ours = read_header(f).get("fingerprint") == self.fp
                h = bytes.fromhex(name[:-4])
            except (OSError, ValueError):
                ours = False
            if not ours:
                others += 1
                continue
            st = os.stat(path)
            found.append((st.st_mtime, h, st.st_size))
        for _, h, size in sorted(found):
            self._add(h, size)
        if others:
            log.info("disk KV tier %s: ignored %d files of another model, dtype, page size or layout",
                     self.directory, others)
        if found:
            log.info("disk KV tier %s: %d blocks (%.1f MB) from an earlier run", self.directory, len(found),
                     self.nbytes / 1e6)
        self._trim()

    def __contains__(self, h: bytes) -> bool:
        with self._lock:
            return h in self.index

    def put(self, h: bytes, block: KVBlock | StateSnapshot) -> bool:
        """Queues the block for writing; False (dropped) when the writer is
        max_queued_bytes behind."""
        if h in self:
            return True
        with self._lock:
            if self.queued_bytes + block.nbytes > self.max_queued_bytes:
                self.counts.dropped += 1
                return False
            self.queued_bytes += block.nbytes
        self._queue.put_nowait((h, block))
        return True

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            h, block = item
            try:
                self._write(h, block)
            except OSError as e:  # a full or read-only disk loses the block, nothing else
                log.warning("disk KV tier: could not write a block (%s)", e)
                self.counts.dropped += 1
            finally:
                with self._lock:
                    self.queued_bytes -= block.nbytes
                self._queue.task_done()

    def _write(self, h: bytes, block: KVBlock | StateSnapshot) -> None:
        data = encode(block, self.fp)
        if len(data) > self.budget_bytes:
            self.counts.dropped += 1
            return
        tmp = self._path(h) + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self._path(h))  # a reader never sees half a file under the real name
        with self._lock:
            if h not in self.index:
                self._add(h, len(data))
                self.counts.stored += not is_snapshot_key(h)
        self._trim()

    def _add(self, h: bytes, size: int) -> None:  # [lock]
        self.index[h] = size
        self.nbytes += size
        self.num_snapshots += is_snapshot_key(h)

    def _removed(self, h: bytes, size: int) -> None:  # [lock] h just left the index
        self.nbytes -= size
        self.num_snapshots -= is_snapshot_key(h)

    def _trim(self) -> None:
        while True:
            with self._lock:
                if self.nbytes <= self.budget_bytes or not self.index:
                    return
                h, size = self.index.popitem(last=False)
                self._removed(h, size)
            self._unlink(h)

    def _unlink(self, h: bytes) -> None:
        try:
            os.unlink(self._path(h))
        except FileNotFoundError:
            pass

    def _forget(self, h: bytes) -> None:
        with self._lock:
            size = self.index.pop(h, None)
            if size is not None:
                self._removed(h, size)

    def get(self, h: bytes) -> KVBlock | StateSnapshot | None:
        """The block (a snapshot under a snapshot key), checked; a bad file is deleted and
        None returned."""
        with self._lock:
            if h not in self.index:
                return None
            self.index.move_to_end(h)
        try:
            with open(self._path(h), "rb") as f:
                block = decode(f.read(), self.fp)
            if is_snapshot_key(h) != isinstance(block, StateSnapshot):
                raise ValueError("a block and a state snapshot swapped names")
        except (OSError, ValueError, KeyError, json.JSONDecodeError, struct.error) as e:
            log.warning("disk KV tier: refused block %s (%s); it will be recomputed", h.hex()[:12], e)
            self.corrupt += 1
            self._forget(h)
            self._unlink(h)
            return None
        os.utime(self._path(h))  # recently used, for the next restart's order
        return block

    def flush(self) -> None:
        """Waits until every queued block is written (tests, shutdown)."""
        self._queue.join()

    def clear(self) -> None:
        """The weights changed (Engine.update_weights): every file of this fingerprint is
        deleted, and later files get a new one, so no run of the old weights reads them."""
        self.flush()
        with self._lock:
            hashes, self.index = list(self.index), OrderedDict()
            self.nbytes = self.num_snapshots = 0
            self.fp = hashlib.blake2b((self.fp + ":updated").encode(), digest_size=16).hexdigest()
        for h in hashes:
            self._unlink(h)

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join(timeout=10)

    def stats(self) -> dict:
        c = self.counts
        with self._lock:
            return {"disk_kv_cache_bytes": self.nbytes, "disk_kv_pages_used": len(self.index) - self.num_snapshots,
                    "disk_state_snapshots": self.num_snapshots, "disk_state_snapshot_hits": self.snapshot_hits,
                    "disk_kv_queries": c.queries, "disk_kv_hits": c.hits, "disk_kv_saved": c.stored,
                    "disk_kv_dropped": c.dropped, "disk_kv_corrupt": self.corrupt}
