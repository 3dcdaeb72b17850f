"""Every change to a request's progress after scheduling, in one place.

    schedule()            admits, allocates, preempts            (batching.py)
    on_dispatch()         the step left for the device: num_computed covers the chunk,
                          a sampling chunk leaves one token in flight
    update_from_output()  one row of a finished step: pages published, the token recorded,
                          the stop the ids decide (EOS, stop ids, max_tokens, max_model_len)
    update_pooled()       the same for a pooling request's row: no token; done at its prompt's end
    restored()            host-tier pages written back (they join the prefix cache), or
                          not (the request recomputes its prompt)
    rewind()              an interrupt lost steps: recompute from what the host knows
    finish()              stop / length / abort / error: out of the queues, pages freed
                          (or kept for a disaggregated pull), status FINISHED
    admit_prefilled()     a request whose prompt K/V arrived from another engine

Nothing outside engine/scheduler/ assigns a request's num_computed, in_flight,
pending_row, output_ids, pages, page_hashes, status, finish_reason or cached_tokens
(tests/test_state_ownership.py walks the code to prove it). Text (detokenization, stop
strings, logprob formatting) is not progress: engine/output.py makes it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterable

from jaxfill.engine.request import QueueFull, Request, Status
from jaxfill.engine.structured_output import advance


@dataclasses.dataclass
class Sampled:
    """A token a step drew for a request, now recorded in its output_ids."""

    token: int
    reason: str | None  # the finish reason the ids alone decide, or None


class RequestTransitions:
    """Mixin of Scheduler (batching.py): reads its queues, block manager and limits."""

    def on_dispatch(self, out, first_row: int = 0) -> None:
        """The step holding `out` (a SchedulerOutput) was dispatched: its requests advance as
        if it had finished, so the next step can be scheduled before its tokens are known
        (async scheduling; engine/async_step.py). `first_row` is the replica's first row."""
        for i, sch in enumerate(out.seqs):
            req = sch.req
            if req.status != Status.RUNNING:
                continue
            req.num_computed = sch.start + sch.num_new
            if self.snapshots is not None:
                end = self.snapshots.boundary(sch.start, sch.num_new, req.num_tokens)
                if end is not None:
                    self.snapshots.record(req.state_slot, self.prefix.hashes(req, end)[-1])
            if 0 < sch.start + sch.num_new == self._state_export_at(req):
                self.state_exports.append((req.request_id, req.state_slot))
            if sch.samples:
                req.in_flight += 1
                req.pending_row = first_row + i

    def update_from_output(self, sch, token: int, now: float) -> Sampled | None:
        """One row of a step whose results reached the host. The request may have been
        scheduled again since (its next step is in flight), preempted (the token still
        counts) or finished (the row is dropped: None)."""
        req = sch.req
        if req.finished:
            return None  # aborted or stopped; a token computed past the stop is dropped here
        if req.status == Status.RUNNING:  # re-admitted since: not beyond what it has computed
            self.prefix.publish(req, min(sch.start + sch.num_new, req.num_computed), sch.start)
        if not sch.samples:
            return None
        req.in_flight -= 1
        return Sampled(token, self._record_token(req, token, now))

    def update_pooled(self, sch) -> bool:
        """A pooling request's row (engine/pooling/): its pages published as any chunk's; True
        when the chunk ended its prompt, which then finishes with no token drawn."""
        req = sch.req
        if req.finished:
            return False
        if req.status == Status.RUNNING:
            self.prefix.publish(req, min(sch.start + sch.num_new, req.num_computed), sch.start)
        if not sch.samples:
            return False
        req.in_flight -= 1
        return True

    def _record_token(self, req: Request, token: int, now: float) -> str | None:
        p = req.params
        req.output_ids.append(token)
        if req.first_token is None:
            req.first_token = now
        req.last_token = now
        grammar = advance(req.matcher, token) if req.matcher is not None else None
        if token in req.eos_token_ids or token in p.stop_token_ids:
            return "stop"
        if grammar is not None:
            return grammar
        if len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def restored(self, sch, ok: bool) -> None:
        """The engine wrote sch.restores into their pages (ok), which now join the device's
        prefix cache; or it could not, and the request goes back to waiting to recompute
        its prompt from the start: a restore that failed never serves K/V."""
        req = sch.req
        if ok:
            self.prefix.publish(req, upto=sch.start)
            for r in sch.restores:
                (self.tier.counts if r.tier == "host" else self.tier.disk.counts).hits += 1
            return
        if req in self.running:
            self.running.remove(req)
        self._release(req)
        req.num_computed = 0
        self.cached_tokens_total -= req.cached_tokens or 0
        req.cached_tokens = None
        self.add(req)

    def rewind(self, scheduled: Iterable, done: set[int]) -> None:
        """These Scheduled rows' results are lost (those whose id() is in `done` were
        taken): their requests recompute from the tokens the host knows."""
        if self.snapshots is not None:
            self.snapshots.drop_pending()
        for sch in scheduled:
            req = sch.req
            req.in_flight = 0
            req.pending_row = -1
            if id(sch) not in done and req.status == Status.RUNNING:
                # a recurrent state (linear-attention hybrids) may hold the lost rows: start over
                req.num_computed = 0 if req.state_slot is not None else min(req.num_computed, sch.start)

    def finish(self, req: Request, reason: str, error: str | None = None, keep_pages: bool = False,
               num_output_tokens: int | None = None) -> None:
        """Ends the request: out of the queues, pages freed, unless `keep_pages` (a held
        prefill: whoever read req.pages before now owns them). `num_output_tokens` cuts
        output_ids first (a stop string found in the text after that many tokens)."""
        if num_output_tokens is not None:
            del req.output_ids[num_output_tokens:]
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.state_holds.discard(req.request_id)
        if keep_pages:
            req.pages = []  # held: whoever read them owns them (a hybrid's slot goes back: its state was exported)
        self._release(req)
        self.spec_finished(req)  # suffix decoding learns its output (verification.py)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.error = error
        req.finished_at = time.perf_counter()

    # ------------------------------------------------------------------ disaggregation
    def reserve_prefilled(self, num_tokens: int) -> tuple[list[int], int | None]:
        """Pages for a prefilled prompt's rows, and a hybrid's state slot (else None),
        before they are written; QueueFull when the batch, the pool or the slots have no room."""
        if len(self.running) >= self.max_seqs:
            raise QueueFull(f"{len(self.running)} requests running (engine.max_num_seqs)")
        if self.slots_used and not self.free_slots:
            raise QueueFull("every recurrent-state slot is held (engine.max_num_seqs)")
        need = self.bm.pages_for(num_tokens)
        if not self.bm.can_allocate(need):
            raise QueueFull(f"{need} pages for a prefilled prompt; {self.bm.num_free} free")
        return self.bm.allocate(need), (self.free_slots.pop() if self.slots_used else None)

    def free_pages(self, pages: list[int], state_slot: int | None = None) -> None:
        """Pages (and a state slot) held outside any request (reserved, or kept for a pull) go back."""
        self.bm.free(pages)
        if state_slot is not None:
            self.free_slots.append(state_slot)

    def admit_prefilled(self, req: Request, pages: list[int], num_tokens: int, cached_tokens: int,
                        state_slot: int | None = None) -> None:
        """The request runs on from its last prompt token; its first num_tokens rows are
        already in `pages`, a hybrid's state in `state_slot` (reserve_prefilled)."""
        req.pages = pages
        req.state_slot = state_slot
        req.num_computed = num_tokens
        req.cached_tokens = cached_tokens
        req.first_scheduled = time.perf_counter()
        req.status = Status.RUNNING
        self.running.append(req)
        self.prefix.publish(req)
