"""The runner's side of the host KV tier: it owns the cache, so saves and restores go
through it (engine/kv_tier/page_offload.py does the moving, engine/step_phases.py decides when).

In a multi-process engine process 0 tells the others what to save and restore (KV_SAVE,
KV_RESTORE, KV_WARMUP lockstep messages, sent before the programs they announce), and
each process moves its own copy from its own tier.
"""

from __future__ import annotations

import dataclasses

from jaxfill.engine.kv_tier.page_offload import decode_entries, encode_entries
from jaxfill.engine.lockstep import KV_RESTORE, KV_SAVE


class RunnerKVTier:
    """Mixin of Runner (engine/runner.py): reads its kv_cache, kv_offload, lockstep, mesh."""

    def save_evicted(self) -> None:
        """Before any write to the cache: evicted pages still to save are gathered first
        (multi-process: on every process, told by a KV_SAVE message)."""
        offload = self.kv_offload
        if offload is None or not offload.queued:
            return
        if self.lockstep is not None:
            offload.sync()
            self.lockstep.send(KV_SAVE, words=encode_entries([q[0] for q in offload.queued],
                                                             [q[1] for q in offload.queued]))
        with self.mesh_context():
            offload.save_evicted(self.kv_cache)

    def restore(self, entries: list[tuple[int, int, bytes]]) -> set[bytes]:
        """(replica, page, block hash) triples: the host tier's blocks written into those
        pages (the cache is donated and replaced). Returns the hashes whose block could
        not be read (a damaged disk file): their pages were not written."""
        self.save_evicted()
        offload = self.kv_offload
        offload.sync()
        blocks = [offload.tier.take(h) for _, _, h in entries]
        kept = [(replica * self.num_pages + page, h, b)
                for (replica, page, h), b in zip(entries, blocks) if b is not None]
        if kept:
            if self.lockstep is not None:
                    self.lockstep.send(KV_RESTORE, words=encode_entries([k[0] for k in kept], [k[1] for k in kept]))
            self._write_blocks([k[0] for k in kept], [k[2] for k in kept])
        return {h for (_, _, h), b in zip(entries, blocks) if b is None}

    def save_states(self, saves: list[tuple[int, bytes]]) -> None:
        """(snapshot slot, hash): a hybrid's snapshots about to lose their slots, gathered
        for the host tier before the copies that reuse the slots (engine/kv_tier/snapshot_offload.py)."""
        states = self.kv_offload.states if self.kv_offload is not None else None
        if saves and states is not None:
            with self.mesh_context():
                states.save(self.kv_cache, saves)

    def restore_state(self, h: bytes, slot: int) -> bool:
        """The host tier's snapshot at page hash h written into working slot `slot`; False
        when the tier no longer holds it (nothing written)."""
        with self.mesh_context():
            new = self.kv_offload.states.restore(self.kv_cache, h, slot)
        if new is None:
            return False
        self.kv_cache = new
        return True

    def _write_blocks(self, pages: list[int], blocks: list) -> None:
        with self.mesh_context():
            new = self.kv_offload.restore(self.kv_cache, pages, blocks)
        self.kv_cache = dataclasses.replace(self.kv_cache, pages=new)

    def _follow_kv(self, op: int, words) -> None:
        """Follower: process 0's save or restore, from this process's own tier."""
        offload = self.kv_offload
        pages, hashes = decode_entries(words)
        offload.sync()
        if op == KV_SAVE:
            offload.queued = [(p, h, None, ()) for p, h in zip(pages, hashes)]
            with self.mesh_context():
                offload.save_evicted(self.kv_cache)
            return
        blocks = [offload.tier.take(h) for h in hashes]
        if any(b is None for b in blocks):  # the tiers split: a bug, and this process's K/V would be wrong
            raise RuntimeError("a block process 0 restores is missing from this process's host KV tier")
        self._write_blocks(pages, blocks)

    def _warm_kv_offload(self) -> None:
        with self.mesh_context():
            self.kv_cache = dataclasses.replace(self.kv_cache, pages=self.kv_offload.warmup(self.kv_cache))
            if self.kv_offload.states is not None:  # a snapshot's gather and write, on the null slot
                from jaxfill.engine import kv_rows

                null = self.config.engine.state_pool_slots - 1
                self.kv_cache = kv_rows.import_state(self.kv_cache, kv_rows.export_state(self.kv_cache, null), null)
