"""The prefix cache's disk tier: blocks pushed out of the host tier, kept as files.

One file per block, `<hash hex>.kvb` in `engine.disk_kv_cache_dir`:

    b"JFKV1\\n" | u32 header length | header JSON | values bytes | scales bytes

The header holds the engine's fingerprint (model, weights, dtype, page size, layout:
`fingerprint()`), the block's parent hash and tokens, the arrays' shapes and dtypes, and a
blake2b checksum of the payload. A restarted engine with the same fingerprint indexes the
files it finds and serves them; files of another fingerprint are left alone (another
engine may own them) with one log line. A file that is short, unreadable or fails its
checksum is deleted when read and counts as a miss: never served.

Writes run on one background thread through a queue bounded in bytes (by default the
host tier's budget, so blocks waiting for the disk at most double the host memory used),
so the stepping thread never waits on the disk; past the bound a block is dropped
(counted). Reads
happen on the stepping thread at admission, one block file per page hit. LRU within
`engine.disk_kv_cache_gb` (a restart orders old files by modification time).
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

import numpy as np

from jaxfill.engine.kv_tier.host import KVBlock, TierCounts

log = logging.getLogger("jaxfill.kv_tier")

MAGIC = b"JFKV1\n"


def fingerprint(config, layout: dict) -> str:
    """What must match for a file's K/V to be valid here: the model (its config, and the
    checkpoint's files or the random-init seed), the cache dtype, the page size and layout."""
    parts = {"model": repr(config.model), "page_size": config.engine.page_size,
             "kv_cache_dtype": config.engine.kv_cache_dtype, "layout": layout}
    if config.model_path:
        files = sorted(f for f in os.listdir(config.model_path) if f.endswith((".safetensors", ".json")))
        parts["checkpoint"] = [(f, os.path.getsize(os.path.join(config.model_path, f)),
                                int(os.path.getmtime(os.path.join(config.model_path, f)))) for f in files]
    return hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=16).hexdigest()


def _payload(block: KVBlock) -> list[bytes]:
    return [np.ascontiguousarray(block.values).tobytes()] + (
        [] if block.scales is None else [np.ascontiguousarray(block.scales).tobytes()])


def encode(block: KVBlock, fp: str) -> bytes:
    payload = b"".join(_payload(block))
    header = {"fingerprint": fp, "parent": None if block.parent is None else block.parent.hex(),
              "tokens": list(block.tokens),
              "values": [list(block.values.shape), block.values.dtype.name],
              "scales": None if block.scales is None else [list(block.scales.shape), block.scales.dtype.name],
              "checksum": hashlib.blake2b(payload, digest_size=16).hexdigest()}
    head = json.dumps(header).encode()
    return MAGIC + struct.pack("<I", len(head)) + head + payload


def read_header(f) -> dict:
    if f.read(len(MAGIC)) != MAGIC:
        raise ValueError("not a jaxfill KV block file")
    (n,) = struct.unpack("<I", f.read(4))
    return json.loads(f.read(n))


def _dtype(name: str) -> np.dtype:
    import ml_dtypes  # noqa: F401  registers bfloat16 / float8 names with numpy (a jax dependency)

    return np.dtype(getattr(ml_dtypes, name, name))


def decode(data: bytes, fp: str) -> KVBlock:
    """The block in `data`; ValueError if it is not whole, not ours, or not what was written."""
    import io

    f = io.BytesIO(data)
    header = read_header(f)
    if header.get("fingerprint") != fp:
        raise ValueError("written by another model or layout")
    payload = f.read()
    if hashlib.blake2b(payload, digest_size=16).hexdigest() != header["checksum"]:
        raise ValueError("checksum mismatch")
    arrays, at = [], 0
    for spec in (header["values"], header["scales"]):
        if spec is None:
            arrays.append(None)
            continue
        shape, dtype = tuple(spec[0]), _dtype(spec[1])
        n = int(np.prod(shape)) * dtype.itemsize
        if at + n > len(payload):
            raise ValueError("truncated")
        arrays.append(np.frombuffer(payload, dtype, count=int(np.prod(shape)), offset=at).reshape(shape).copy())
        at += n
    parent = None if header["parent"] is None else bytes.fromhex(header["parent"])
    return KVBlock(arrays[0], arrays[1], parent, tuple(header["tokens"]))


class DiskKVTier:
    def __init__(self, directory: str, budget_bytes: int, fp: str, max_queued_bytes: int = 1 << 28):
        self.directory = directory
        self.budget_bytes = int(budget_bytes)
        self.fp = fp
        self.max_queued_bytes = int(max_queued_bytes)
        self.queued_bytes = 0  # blocks handed to the writer thread and not yet written
        self.counts = TierCounts()
        self.corrupt = 0  # files refused on read (short, unreadable, checksum)
        self.index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes, LRU first
        self.nbytes = 0
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
            self.index[h] = size
            self.nbytes += size
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

    def put(self, h: bytes, block: KVBlock) -> bool:
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

    def _write(self, h: bytes, block: KVBlock) -> None:
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
                self.index[h] = len(data)
                self.nbytes += len(data)
                self.counts.stored += 1
        self._trim()

    def _trim(self) -> None:
        while True:
            with self._lock:
                if self.nbytes <= self.budget_bytes or not self.index:
                    return
                h, size = self.index.popitem(last=False)
                self.nbytes -= size
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
                self.nbytes -= size

    def get(self, h: bytes) -> KVBlock | None:
        """The block, checked; a bad file is deleted and None returned."""
        with self._lock:
            if h not in self.index:
                return None
            self.index.move_to_end(h)
        try:
            with open(self._path(h), "rb") as f:
                block = decode(f.read(), self.fp)
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
            self.nbytes = 0
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
            return {"disk_kv_cache_bytes": self.nbytes, "disk_kv_pages_used": len(self.index),
                    "disk_kv_queries": c.queries, "disk_kv_hits": c.hits, "disk_kv_saved": c.stored,
                    "disk_kv_dropped": c.dropped, "disk_kv_corrupt": self.corrupt}
