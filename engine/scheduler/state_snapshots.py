"""Recurrent-state snapshots: what makes prefix caching safe for linear-attention hybrids.

A Gated DeltaNet layer keeps one state per sequence, not a row per token, so a cached
prefix's KV pages alone cannot resume a request: it also needs the state exactly at the
prefix's end. Every `interval` tokens (engine.state_snapshot_tokens, a multiple of the
page size) a request's working slot is copied into a snapshot slot, keyed by the page
hash that ends there (the same chain that keys the KV pages: equal hash, equal prefix
and salt). A later request whose cached pages reach such a boundary takes a copy of that
snapshot into its *own* working slot and resumes there; it never reads a slot another
request owns (the tpu-inference #3412 failure: state indexed by a reused request slot).

The scheduler cuts prefill chunks at boundaries so a step ends exactly on one. Snapshots
are recorded when the step is dispatched (`record`) and copied before the next step
runs (`take_copies`): the device runs the copy after the step that computed the state
and before any later step writes that working slot. A snapshot whose boundary page has
left the prefix cache goes first when a slot is needed, then the least recently used.
"Left" means it was cached once: under async scheduling a fresh snapshot's page joins the
cache only when its step's results come back, and must not count as stale before that.

With the host tier (engine/kv_tier/host.py) a snapshot leaving its slot is saved there
(`take_evicted`: gathered before the copy that reuses the slot), so prefix pages that
come back from the host can resume too: `resume_pages` also counts a boundary whose
snapshot the host holds (`on_host`; or the disk tier below it), and the admission writes
that snapshot into the request's own slot before its step (engine/kv_tier/restore.py).

Pure Python: the copies are (source slot, destination slot) pairs for the runner.
"""

from __future__ import annotations

from collections import OrderedDict


class StateSnapshots:
    def __init__(self, interval: int, first_slot: int, num_slots: int, on_host=None):
        if interval <= 0 or num_slots <= 0:
            raise ValueError(f"need a positive interval and slot count, got {interval}, {num_slots}")
        self.interval = interval
        self.slots = OrderedDict()  # hash -> snapshot slot, least recently used first
        self.free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self.pending: list[tuple[int, bytes]] = []  # (working slot, hash) of dispatched steps
        self.taken = 0  # snapshots copied
        self.hits = 0  # admissions that resumed from one
        # on_host(h): the host tier holds the snapshot at h (None: no host tier)
        self.on_host = on_host
        self.evicted: list[tuple[int, bytes]] = []  # (snapshot slot, hash) leaving the device, to save
        self.host_hits = 0  # admissions that resumed from a snapshot the host tier kept
        self.seen_cached: set[bytes] = set()  # snapshots whose boundary page the prefix cache has held

    # ------------------------------------------------------------------ chunks
    def cut(self, start: int, n: int, known: int) -> int:
        """The chunk [start, start + n) ends at the first boundary inside it, when that
        boundary's tokens are known (a state snapshot needs its page hashes)."""
        b = (start // self.interval + 1) * self.interval
        return b - start if b < start + n and b <= known else n

    def boundary(self, start: int, n: int, known: int) -> int | None:
        """The boundary the chunk ends on, if it ends on one whose tokens are known."""
        end = start + n
        return end if end % self.interval == 0 and 0 < end <= known else None

    # ------------------------------------------------------------------ snapshots
    def record(self, working_slot: int, h: bytes) -> None:
        """A dispatched step leaves the state at a boundary (hash h) in working_slot."""
        if h not in self.slots and all(h != p for _, p in self.pending):
            self.pending.append((working_slot, h))

    def take_copies(self, is_cached) -> list[tuple[int, int]]:
        """(working slot, snapshot slot) copies for the pending snapshots, to run before
        the next step; `is_cached(h)` says whether a boundary page is still cached."""
        copies: dict[int, int] = {}  # snapshot slot -> working slot
        self.seen_cached.update(h for h in self.slots if is_cached(h))
        for working, h in self.pending:
            if h in self.slots:
                continue
            slot, old = self._free_slot(is_cached)
            # a snapshot taken in this same call is not in its slot yet: no save, and its copy is void
            if old is not None and slot not in copies and self.on_host is not None:
                self.evicted.append((slot, old))
            self.slots[h] = slot
            copies[slot] = working
        self.taken += len(copies)
        self.pending = []
        return [(working, slot) for slot, working in copies.items()]

    def _free_slot(self, is_cached) -> tuple[int, bytes | None]:
        """A slot for a new snapshot, and the hash of the snapshot it held (None: a free one)."""
        if self.free:
            return self.free.pop(), None
        stale = next((h for h in self.slots if h in self.seen_cached and not is_cached(h)), None)
        old, slot = self.slots.popitem(last=False) if stale is None else (stale, self.slots.pop(stale))
        self.seen_cached.discard(old)
        return slot, old

    def take_evicted(self) -> list[tuple[int, bytes]]:
        """(snapshot slot, hash) of the snapshots take_copies pushed out, to save to the
        host before the copies run."""
        out, self.evicted = self.evicted, []
        return out

    def resume_pages(self, hashes: list[bytes], page_size: int) -> int:
        """How many of these cached pages (hashes of a request's prefix) it can resume
        after: the longest prefix ending on a boundary with a snapshot on the device or the
        host; 0 when none."""
        per = self.interval // page_size
        for k in range(len(hashes) // per * per, 0, -per):
            if hashes[k - 1] in self.slots or (self.on_host is not None and self.on_host(hashes[k - 1])):
                return k
        return 0

    def source(self, h: bytes) -> tuple[int | None, bytes | None]:
        """Where a resume at hash h copies its state from: (snapshot slot, None), now the
        most recently used; or (None, h) when only the host tier holds it."""
        self.hits += 1
        if h in self.slots:
            self.slots.move_to_end(h)
            return self.slots[h], None
        self.host_hits += 1
        return None, h

    def clear(self) -> None:
        """The state arrays were lost (a cache reset): no snapshot can be trusted."""
        self.free += list(self.slots.values())
        self.slots.clear()
        self.seen_cached.clear()
        self.pending = []
        self.evicted = []  # their slots' contents were lost with the arrays

    def drop_pending(self) -> None:
        """Steps were lost (an interrupt): their states are not what the host thinks."""
        self.pending = []
