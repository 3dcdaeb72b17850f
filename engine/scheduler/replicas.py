"""Data parallelism on the host: one Scheduler (and page pool) per 'data' replica, and the
one registry of unfinished requests.

A request lives on one replica from admission to finish: its pages are ids in that
replica's pool, and preemption sends it back to that replica's own waiting queue. A new
request goes to the replica holding the longest cached prefix of its prompt, then to
the one with the fewest unfinished requests. Every step each replica schedules on its
own (its own token budget and max_num_seqs); engine.step pads their batches to one
common bucket and stacks them [R, ...] for the data-parallel step (engine/step.py).

With one replica this is a thin wrapper around one Scheduler.
"""

from __future__ import annotations

from typing import Iterable

from jaxfill.engine.request import InvalidRequest, Request
from jaxfill.engine.scheduler.batching import Scheduler
from jaxfill.engine.scheduler.step_plan import SchedulerOutput
from jaxfill.engine.scheduler.transitions import Sampled
from jaxfill.engine.speculative.acceptance import SpecCounters
from jaxfill.engine.speculative.policy import PolicyCounters


class ReplicaScheduler:
    def __init__(self, settings, num_replicas: int = 1, tier=None, on_evict=None, page_ranks: int = 1,
                 speculative=None):
        """`tier`: the host KV tier all replicas share (None: off); `on_evict(replica, page,
        hash, parent, tokens)` hears the pages each replica's pool evicts (to save them);
        `page_ranks`: mesh.sequence, the ranks each replica's pool is dealt over;
        `speculative`: the config's SpeculativeSettings (None: off)."""
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.replicas = [Scheduler(settings, tier=tier, page_ranks=page_ranks, speculative=speculative)
                         for _ in range(num_replicas)]
        if on_evict is not None:
            for i, s in enumerate(self.replicas):
                s.bm.on_evict = lambda *ev, _i=i: on_evict(_i, *ev)
        self.num_added = [0] * num_replicas  # new requests placed on each replica
        self.requests: dict[str, Request] = {}  # unfinished, by id: read it, never write it

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

    def _register(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise InvalidRequest("request_id", f"{req.request_id!r} is already in flight")
        self.requests[req.request_id] = req

    def check_replica(self, replica: int | None) -> None:
        """A pinned replica (the protocol's data_parallel_rank) must be one of ours."""
        if replica is not None and not (isinstance(replica, int) and 0 <= replica < len(self.replicas)):
            raise InvalidRequest("data_parallel_rank", f"must be in [0, {len(self.replicas)}) (mesh.data), "
                                 f"got {replica!r}")

    def add(self, req: Request, replica: int | None = None) -> None:
        """`replica`: pinned by the caller (data_parallel_rank; check_replica first), else placed."""
        self._register(req)
        if req.prefill_after is not None:  # a sample beside the one whose prompt pages it shares
            req.replica = req.prefill_after.replica
        elif replica is not None:
            req.replica = replica
        else:
            req.replica = self._place(req) if len(self.replicas) > 1 else 0
        self.replicas[req.replica].add(req)
        self.num_added[req.replica] += 1

    def _place(self, req: Request) -> int:
        def score(i: int):
            s = self.replicas[i]
            return -len(s.prefix.device_prefix(req)), len(s.waiting) + len(s.running), i
        return min(range(len(self.replicas)), key=score)

    def schedule(self) -> list[SchedulerOutput]:
        """One SchedulerOutput per replica (empty ones included: they still take a row block)."""
        outs = [s.schedule() for s in self.replicas]
        for req in (r for out in outs for r in out.finished):
            self.requests.pop(req.request_id, None)
        return outs

    def recompute_all(self) -> None:
        """The KV cache was lost: every running request goes back to waiting, to be recomputed."""
        for s in self.replicas:
            s.recompute_all()

    # ------------------------------------------------------------------ transitions
    def on_dispatch(self, outs: list[SchedulerOutput], rows_per_replica: int) -> None:
        for i, out in enumerate(outs):
            self.replicas[i].on_dispatch(out, first_row=i * rows_per_replica)

    def update_from_output(self, sch, token: int, now: float) -> Sampled | None:
        return self.replicas[sch.req.replica].update_from_output(sch, token, now)

    def update_pooled(self, sch) -> bool:
        return self.replicas[sch.req.replica].update_pooled(sch)

    def verify(self, sch, targets: list[int]) -> list[int]:
        return self.replicas[sch.req.replica].verify(sch, targets)

    def record_verified(self, sch, token: int, now: float) -> Sampled:
        return self.replicas[sch.req.replica].record_verified(sch, token, now)

    def settle(self, sch, num_emitted: int) -> None:
        self.replicas[sch.req.replica].settle(sch, num_emitted)

    def restored(self, sch, ok: bool) -> None:
        self.replicas[sch.req.replica].restored(sch, ok)

    def rewind(self, scheduled: Iterable, done: set[int]) -> None:
        self.replicas[0].rewind(scheduled, done)  # touches only the requests

    def finish(self, req: Request, reason: str, error: str | None = None, keep_pages: bool = False,
               num_output_tokens: int | None = None) -> None:
        self.replicas[req.replica].finish(req, reason, error, keep_pages, num_output_tokens)
        self.requests.pop(req.request_id, None)

    def place_prefilled(self, num_tokens: int, replica: int | None = None) -> int:
        """The replica a prefilled request's pulled rows go to: `replica` when pinned, else
        the one with the fewest unfinished requests among those with room for the rows
        (then the most free pages, then the lowest index)."""
        if replica is not None:
            return replica
        def score(i: int):
            s = self.replicas[i]
            return not s.bm.can_allocate(s.bm.pages_for(num_tokens)), len(s.waiting) + len(s.running), \
                -s.bm.num_free, i
        return min(range(len(self.replicas)), key=score)

    def reserve_prefilled(self, num_tokens: int, replica: int = 0) -> tuple[list[int], int | None]:
        """Pages in `replica`'s pool (ids local to it) and a hybrid's state slot."""
        return self.replicas[replica].reserve_prefilled(num_tokens)

    def free_pages(self, pages: list[int], replica: int = 0, state_slot: int | None = None) -> None:
        self.replicas[replica].free_pages(pages, state_slot)

    def hold_state(self, request_id: str) -> None:
        """A hybrid's held prefill: its state at len(prompt) - 1 is exported (its replica's)."""
        req = self.requests.get(request_id)
        self.replicas[0 if req is None else req.replica].state_holds.add(request_id)

    def admit_prefilled(self, req: Request, pages: list[int], num_tokens: int, cached_tokens: int,
                        state_slot: int | None = None, replica: int = 0) -> None:
        """Onto `replica`, whose pool holds `pages` (and slot) from reserve_prefilled."""
        self._register(req)
        req.replica = replica
        self.replicas[replica].admit_prefilled(req, pages, num_tokens, cached_tokens, state_slot)
        self.num_added[replica] += 1

    def set_listener(self, listener) -> None:
        """listener(replica, *event) hears each replica's prefix-cache events; None removes it."""
        for i, s in enumerate(self.replicas):
            s.bm.listener = None if listener is None else (lambda *ev, _i=i: listener(_i, *ev))

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
            **self._snapshot_stats(),
            **self._spec_stats(),
        }

    def wants_proposals(self) -> bool:
        """Whether a step planned now could carry proposals (verification.py); one replica only."""
        return any(s.wants_proposals() for s in self.replicas)

    def _spec_stats(self) -> dict:
        """Speculative decoding's proposed / accepted counts (engine/speculative/); {} when off."""
        counters = [s.spec for s in self.replicas if s.speculative is not None and s.speculative.enabled]
        if not counters:
            return {}
        policies = PolicyCounters.total([s.spec_policy.counters for s in self.replicas if s.spec_policy is not None])
        return {**SpecCounters.total(counters).stats(), **policies.stats()}

    def _snapshot_stats(self) -> dict:
        """Linear-attention state snapshots (prefix caching of hybrids); {} for other models."""
        snaps = [s.snapshots for s in self.replicas if s.snapshots is not None]
        if not snaps:
            return {}
        return {"state_snapshots_kept": sum(len(x.slots) for x in snaps),
                "state_snapshots_taken": sum(x.taken for x in snaps),
                "state_snapshot_hits": sum(x.hits for x in snaps)}
