"""Data parallelism on the host: one Scheduler (and page pool) per 'data' replica.

A request lives on one replica from admission to finish: its pages are ids in that
replica's pool, and preemption sends it back to that replica's own waiting queue. A new
request goes to the replica holding the longest cached prefix of its prompt, then to
the one with the fewest unfinished requests. Every step each replica schedules on its
own (its own token budget and max_num_seqs); engine.step pads their batches to one
common bucket and stacks them [R, ...] for the data-parallel step (engine/step.py).

With one replica this is a thin wrapper around one Scheduler.
"""

from __future__ import annotations

from jaxfill.engine.request import Request
from jaxfill.engine.scheduler import Scheduler, SchedulerOutput


class ReplicaScheduler:
    def __init__(self, settings, num_replicas: int = 1):
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.replicas = [Scheduler(settings) for _ in range(num_replicas)]
        self.num_added = [0] * num_replicas  # new requests placed on each replica

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    @property
    def waiting(self) -> list[Request]:
        return [r for s in self.replicas for r in s.waiting]

    @property
    def running(self) -> list[Request]:
        return [r for s in self.replicas for r in s.running]

    def num_waiting(self) -> int:
        return sum(len(s.waiting) for s in self.replicas)

    def add(self, req: Request) -> None:
        req.replica = self._place(req) if len(self.replicas) > 1 else 0
        self.replicas[req.replica].add(req)
        self.num_added[req.replica] += 1

    def _place(self, req: Request) -> int:
        def score(i: int):
            s = self.replicas[i]
            return -len(s.cached_prefix(req)), len(s.waiting) + len(s.running), i
        return min(range(len(self.replicas)), key=score)

    def remove(self, req: Request) -> None:
        self.replicas[req.replica].remove(req)

    def register_computed(self, req: Request, upto: int | None = None, start: int = 0) -> None:
        self.replicas[req.replica].register_computed(req, upto, start)

    def schedule(self) -> list[SchedulerOutput]:
        """One SchedulerOutput per replica (empty ones included: they still take a row block)."""
        return [s.schedule() for s in self.replicas]

    def recompute_all(self) -> None:
        """The KV cache was lost: every running request goes back to waiting, to be recomputed."""
        for s in self.replicas:
            s.recompute_all()

    def stats(self) -> dict:
        bms = [s.bm for s in self.replicas]
        return {
            "data_replicas": len(self.replicas),
            "pages_total": sum(b.num_usable for b in bms),
            "pages_free": sum(b.num_free for b in bms),
            "pages_cached": sum(len(b.cached) for b in bms),
            "num_running": sum(len(s.running) for s in self.replicas),
            "num_waiting": self.num_waiting(),
            "requests_per_replica": list(self.num_added),
            "prefix_cache_hits": sum(b.hits for b in bms),
            "prefix_cache_queries": sum(b.queries for b in bms),
            "cached_tokens_total": sum(s.cached_tokens_total for s in self.replicas),
            "num_preemptions": sum(s.num_preemptions for s in self.replicas),
        }
