"""Moves a linear-attention hybrid's state snapshots between the device's snapshot slots
and the host tier (engine/kv_tier/host.py), as engine/kv_tier/page_offload.py moves KV pages.

Saves: a snapshot about to lose its slot (engine/scheduler/state_snapshots.py
`take_evicted`) is gathered before the copy that reuses the slot (engine/step_phases.py
`_copy_states`) and copied to the host without waiting; `poll` folds the arrived ones
into the tier under the page's hash, where they count against its byte budget (and go
on to the disk tier as its blocks do). Until then the host does not have it, and a hit
is cut back to a snapshot it has.

Restores: a request admitted at a boundary whose snapshot only the host holds gets it
written into its own fresh working slot before its step (`restore`). A snapshot the
tier dropped meanwhile, or whose file on disk is damaged, fails the restore: the request
recomputes, never resuming from a state that is not its prefix's.

One process only (hybrids refuse several); one program per direction (a slot at a time).
"""

from __future__ import annotations

import numpy as np

from jaxfill.engine import kv_rows
from jaxfill.engine.kv_tier.host import StateSnapshot


class SnapshotOffload:
    def __init__(self, tier):
        self.tier = tier  # HostKVTier
        self.in_transit: list[tuple[bytes, list]] = []  # (hash, [recurrent, conv] on their way)
        self.num_saved = 0  # snapshots folded into the tier
        self.num_restored = 0  # snapshots written into a working slot

    def save(self, cache, saves: list[tuple[int, bytes]]) -> None:
        """Dispatches the gather of each (snapshot slot, hash) and starts its copy to the host."""
        for slot, h in saves:
            if self.tier.has_snapshot(h) or any(h == t for t, _ in self.in_transit):
                continue
            arrays = kv_rows.export_state(cache, slot)  # new buffers: the slot may be reused after this
            for a in arrays:
                a.copy_to_host_async()
            self.in_transit.append((h, arrays))

    def poll(self, wait: bool = False) -> None:
        """Folds the snapshots that reached the host into the tier (`wait`: all of them)."""
        while self.in_transit:
            h, arrays = self.in_transit[0]
            if not wait and not all(a.is_ready() for a in arrays):
                return
            self.in_transit.pop(0)
            recurrent, conv = (np.asarray(a) for a in arrays)
            self.tier.put_snapshot(h, StateSnapshot(recurrent, conv))
            self.num_saved += 1

    def restore(self, cache, h: bytes, slot: int):
        """A new cache with the host's snapshot at h written into `slot` (the old cache is
        donated), or None when the tier no longer holds it (the cache is untouched)."""
        snap = self.tier.get_snapshot(h)
        if snap is None:
            return None
        self.num_restored += 1
        return kv_rows.import_state(cache, [snap.recurrent, snap.conv], slot)

    def stats(self) -> dict:
        return {"host_state_snapshots_saved": self.num_saved,
                "host_state_snapshots_restored": self.num_restored,
                "host_state_snapshots_in_transit": len(self.in_transit)}
