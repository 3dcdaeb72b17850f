"""The prefix cache's host-memory tier: full KV pages evicted from the device, kept by hash.

A block is one page of one prompt prefix with all its layers side by side (the layout
vLLM's offloading found 4x faster to move than a block per layer):

    values [L, P, 2 * Hkv, D]   the cache's dtype (K of head h at 2h, V at 2h + 1)
    scales [L, P, 2 * Hkv]      f32, only for an int8 / fp8 cache

Blocks are keyed by the same hash chain as the device's prefix cache (engine/
block_manager.py: parent hash, tokens and cache_salt), so a hit here is the same prefix
a device hit would be. LRU within a byte budget; a block that does not fit the budget at
all goes straight to the disk tier (dropped without one). A block pushed out goes to the
disk tier when there is one (engine/kv_tier/disk.py), and a disk hit comes back through here.

A linear-attention hybrid's state snapshot at a page (engine/scheduler/state_snapshots.py)
is kept here too, under the same byte budget and LRU, keyed by that page's hash plus a
suffix (`snapshot_key`): a host hit resumes only where its snapshot is here, on the disk
below (pushed out like a block, in the same files' budget) or on the device. Snapshots
make no KV events.

Pure numpy, no JAX: engine/kv_tier/page_offload.py moves blocks between the device and here. One
tier serves every data replica (a block is the same bytes wherever it was computed).
`listener` hears ("stored", hash, parent, tokens, tier) and ("removed", hash, tier)
on the stepping thread, as the block managers' listener does for the device.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Callable

import numpy as np


@dataclasses.dataclass
class KVBlock:
    values: np.ndarray  # [L, P, 2*Hkv, D]
    scales: np.ndarray | None  # [L, P, 2*Hkv] f32, or None
    parent: bytes | None  # the previous page's hash (None for a prompt's first page)
    tokens: tuple[int, ...]  # the page's token ids (for KV events)

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + (0 if self.scales is None else self.scales.nbytes)


@dataclasses.dataclass
class StateSnapshot:
    """Every linear layer's state of one sequence at a snapshot boundary."""

    recurrent: np.ndarray  # [Lin, Hv, Dk, Dv] f32 (Mamba2: [Lin, H, P, N])
    conv: np.ndarray  # [Lin, C, K-1] in the model dtype

    @property
    def nbytes(self) -> int:
        return self.recurrent.nbytes + self.conv.nbytes


def snapshot_key(h: bytes) -> bytes:
    """A snapshot's key: its page's hash and a suffix (page hashes are 16 bytes, so no clash)."""
    return h + b"state"


def is_snapshot_key(key: bytes) -> bool:
    return len(key) == 21 and key.endswith(b"state")


@dataclasses.dataclass
class TierCounts:
    """Pages looked up in / served by one tier (after a device miss), and pages it took in."""

    queries: int = 0
    hits: int = 0
    stored: int = 0
    dropped: int = 0  # would not fit the budget, or the disk writer was full


class HostKVTier:
    def __init__(self, budget_bytes: int, disk=None):
        self.budget_bytes = int(budget_bytes)
        self.blocks: OrderedDict[bytes, KVBlock] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.disk = disk  # engine.kv_tier.disk.DiskKVTier or None
        self.counts = TierCounts()
        self.listener: Callable[..., None] | None = None
        self.num_snapshots = 0  # StateSnapshots among the blocks

    def __contains__(self, h: bytes) -> bool:
        return h in self.blocks or (self.disk is not None and h in self.disk)

    def put(self, h: bytes, block: KVBlock | StateSnapshot) -> None:
        """Keeps a block (most recently used); older blocks make room, to disk if any."""
        if h in self.blocks:
            self.blocks.move_to_end(h)
            return
        if block.nbytes > self.budget_bytes:
            if self.disk is None or not self._to_disk(h, block):
                self.counts.dropped += 1
            return
        while self.nbytes + block.nbytes > self.budget_bytes:
            self._push_out()
        self.blocks[h] = block
        self.nbytes += block.nbytes
        if isinstance(block, StateSnapshot):
            self.num_snapshots += 1
            return
        self.counts.stored += 1
        if self.listener is not None:
            self.listener("stored", h, block.parent, list(block.tokens), "host")

    def _push_out(self) -> None:
        h, block = self.blocks.popitem(last=False)
        self.nbytes -= block.nbytes
        if isinstance(block, StateSnapshot):
            self.num_snapshots -= 1
            return
        if self.listener is not None:
            self.listener("removed", h, "host")
        if self.disk is not None:
            self._to_disk(h, block)

    def _to_disk(self, h: bytes, block: KVBlock | StateSnapshot) -> bool:
        """Hands a block (or snapshot) to the disk tier; False when it was dropped there."""
        if h in self.disk:
            return True
        ok = self.disk.put(h, block)
        if ok and self.listener is not None and isinstance(block, KVBlock):
            self.listener("stored", h, block.parent, list(block.tokens), "disk")
        return ok

    def peek(self, h: bytes) -> str | None:
        """Where a block is kept ("host", "disk") or None; changes nothing (the scheduler's
        lookup: in a multi-process engine only process 0 looks up, so a lookup must not
        move anything its followers' tiers would not)."""
        if h in self.blocks:
            return "host"
        return "disk" if self.disk is not None and h in self.disk else None

    def take(self, h: bytes) -> KVBlock | None:
        """The block to restore (now the most recently used), or None. A disk block is
        read, checked (its checksum) and brought into this tier; a bad one is None."""
        block = self.blocks.get(h)
        if block is not None:
            self.blocks.move_to_end(h)
            return block
        block = None if self.disk is None else self.disk.get(h)
        if block is not None:
            self.put(h, block)
        return block if isinstance(block, KVBlock) else None

    def put_snapshot(self, h: bytes, snapshot: StateSnapshot) -> None:
        self.put(snapshot_key(h), snapshot)

    def has_snapshot(self, h: bytes) -> bool:
        """Whether the snapshot at page hash h is here or on disk (changes nothing)."""
        key = snapshot_key(h)
        return key in self.blocks or (self.disk is not None and key in self.disk)

    def get_snapshot(self, h: bytes) -> StateSnapshot | None:
        """The state snapshot at page hash h (now the most recently used), or None. One on
        disk is read, checked and brought into this tier (a bad file is None)."""
        key = snapshot_key(h)
        if key in self.blocks:
            self.blocks.move_to_end(key)
            return self.blocks[key]
        snap = None if self.disk is None else self.disk.get(key)
        if not isinstance(snap, StateSnapshot):
            return None
        self.disk.snapshot_hits += 1
        self.put(key, snap)
        return snap

    def discard(self, *hashes: bytes) -> None:
        """Forgets these blocks (a restore of them failed: they will be recomputed)."""
        for h in hashes:
            block = self.blocks.pop(h, None)
            if block is not None:
                self.nbytes -= block.nbytes
                self.num_snapshots -= isinstance(block, StateSnapshot)
                if self.listener is not None and isinstance(block, KVBlock):
                    self.listener("removed", h, "host")

    def clear(self) -> None:
        """Forgets every block (the weights changed, say); the disk tier keeps its files."""
        for h, block in self.blocks.items():
            if self.listener is not None and isinstance(block, KVBlock):
                self.listener("removed", h, "host")
        self.blocks.clear()
        self.nbytes = 0
        self.num_snapshots = 0

    def stats(self) -> dict:
        c = self.counts
        out = {"host_kv_cache_bytes": self.nbytes, "host_kv_cache_budget_bytes": self.budget_bytes,
               "host_kv_pages_used": len(self.blocks) - self.num_snapshots, "host_kv_queries": c.queries,
               "host_kv_hits": c.hits, "host_kv_saved": c.stored, "host_kv_dropped": c.dropped,
               "host_state_snapshots": self.num_snapshots}
        if self.disk is not None:
            out.update(self.disk.stats())
        return out
