"""Token-budget continuous batching with no prefill phase (vLLM v1 style), pure Python.

Each step every running request's `num_computed` catches up to its `num_tokens` under
`max_num_batched_tokens`:

1. running decodes (one token each) first, so ongoing streams never stall;
2. then running requests that are mid-prefill, each chunk capped by
   `long_prefill_token_threshold`;
3. then waiting requests (FCFS, or by priority), after a prefix-cache lookup. A prompt
   that would still be unfinished after this step is a *partial* prefill; at most
   `max_num_partial_prefills` of those run at once; other prompts may pass it.

The lookup (prefix_lookup.py) walks the prompt's page hashes: a page cached on the device
is shared; one missing there but kept in the host tier (engine/kv_tier/host.py, when
engine.host_kv_cache_gb > 0) gets a fresh page and a `Restore`, which the engine writes
back before the step (engine/kv_tier/page_offload.py); the first page in neither ends the hit.
Restored pages count as computed, and join the device's prefix cache only once written
(`restored`).

Linear-attention hybrids (engine.state_slots > 0) hold a recurrent-state slot while
running; with prefix caching, chunks are cut at state snapshot boundaries and a hit
resumes only where a snapshot is kept (state_snapshots.py), on the device or, with the
host tier, in host memory (`Scheduled.state_host`: written into the request's slot with
its restores).

When pages run out for a running request, the lowest-priority (latest) running request
is preempted: its pages are freed and it goes back to waiting with num_computed = 0,
to be recomputed (prefix-cache hits make that cheap). A step that preempted admits no
waiting request, so a victim is never re-admitted (and recomputed) in the same step.
Nothing ever crashes for lack of pages; a request that cannot fit even alone finishes
with "length".
"""

from __future__ import annotations

import bisect
import time

from jaxfill.engine.block_manager import BlockManager
from jaxfill.engine.request import Request, Status
from jaxfill.engine.scheduler.prefix_lookup import PrefixLookup
from jaxfill.engine.scheduler.state_snapshots import StateSnapshots
from jaxfill.engine.scheduler.step_plan import Restore, Scheduled, SchedulerOutput, to_compute, total_tokens
from jaxfill.engine.scheduler.transitions import RequestTransitions
from jaxfill.engine.scheduler.verification import Verification


class Scheduler(RequestTransitions, Verification):
    """One data replica's queues and page pool; transitions.py changes its requests' progress,
    verification.py its speculative proposals'."""

    def __init__(self, settings, block_manager: BlockManager | None = None, tier=None, page_ranks: int = 1,
                 speculative=None):
        s = settings
        self.init_speculative(speculative)
        self.page_size = s.page_size
        self.max_tokens = s.max_num_batched_tokens
        self.max_seqs = s.max_num_seqs
        self.max_partial = max(1, s.max_num_partial_prefills)
        self.chunk_cap = s.long_prefill_token_threshold or None
        self.prompt_rows = min(s.prompt_logprobs_rows, s.max_num_batched_tokens)  # scored rows per step
        self.max_model_len = s.max_model_len
        self.policy = s.scheduling_policy
        self.chunked = s.chunked_prefill
        self.bm = block_manager or BlockManager(s.num_pages, s.page_size, s.enable_prefix_caching, page_ranks)
        self.tier = tier  # engine.kv_tier.host.HostKVTier, shared by the replicas; None = off
        # linear-attention hybrids: a recurrent-state slot per running request (engine.state_slots)
        self.slots_used = s.state_slots > 0
        self.free_slots = list(range(s.state_slots - 1, -1, -1))
        # their states at prefix boundaries, so prefix-cache hits can resume (None: no prefix caching)
        self.snapshots = None
        if s.state_slots and s.enable_prefix_caching and s.state_snapshot_slots:
            self.snapshots = StateSnapshots(s.state_snapshot_tokens, s.state_slots, s.state_snapshot_slots,
                                            on_host=tier and tier.has_snapshot)
        self.prefix = PrefixLookup(self.bm, self.page_size, tier, self.snapshots)  # prefix_lookup.py
        # held prefills of a hybrid (disaggregation): their chunks end at len(prompt) - 1,
        # where the state the decode side resumes from is exported
        self.state_holds: set[str] = set()
        self.state_exports: list[tuple[str, int]] = []
        self.waiting: list[Request] = []  # sorted by _key
        self.running: list[Request] = []  # admission order
        self.num_preemptions = 0
        self.cached_tokens_total = 0

    # ------------------------------------------------------------------ queues
    def _key(self, r: Request):
        return (r.priority if self.policy == "priority" else 0, r.arrival_seq)

    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        keys = [self._key(r) for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, self._key(req)), req)

    def _release(self, req: Request) -> None:
        self.bm.free(req.pages)
        req.pages = []
        if req.state_slot is not None:
            self.free_slots.append(req.state_slot)
            req.state_slot = None
        if req.spec_slot is not None:
            self.free_slots.append(req.spec_slot)
            req.spec_slot = None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ pages
    def _grow(self, req: Request, upto: int) -> bool:
        """Allocates pages so the request holds `upto` tokens; False if none are left."""
        need = self.bm.pages_for(upto) - len(req.pages)
        if need <= 0:
            return True
        if not self.bm.can_allocate(need, first=len(req.pages)):
            return False
        req.pages += self.bm.allocate(need, first=len(req.pages))
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed = 0
        req.page_hashes = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.add(req)

    def recompute_all(self) -> None:
        """The KV cache was lost: every running request goes back to waiting, to be
        recomputed, and no cached prefix page can be trusted."""
        for req in list(self.running):
            self._preempt(req)
        self.bm.reset_prefix_cache()
        self.state_exports = []  # read from the lost cache; the held prefills recompute and export again
        if self.snapshots is not None:
            self.snapshots.clear()

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        """This step's plan; first the snapshots the steps dispatched since the last plan
        left (they must be copied even when nothing runs now)."""
        copies, saves = [], []
        if self.snapshots is not None:
            copies = self.snapshots.take_copies(lambda h: self.bm.page_of(h) is not None)
            saves = self.snapshots.take_evicted()
        out = self._schedule()
        out.state_copies, out.state_saves = copies + self.state_before_verify(out.seqs), saves
        out.state_exports, self.state_exports = self.state_exports, []
        return out

    def _chunk(self, req: Request, start: int, n: int) -> int:
        """n new tokens from `start`, cut by the long-prefill cap, at a state snapshot boundary,
        and before an image whose rows attend each other both ways (Gemma 3: never split)."""
        if self.chunk_cap and total_tokens(req) - start > 1:
            n = min(n, self.chunk_cap)
        if req.images is not None:
            n = req.images.cut(start, n)
        if self.snapshots is not None:
            n = self.snapshots.cut(start, n, req.num_tokens)
        end = self._state_export_at(req)
        if start < end < start + n:
            n = end - start
        return n

    def _state_export_at(self, req: Request) -> int:
        """Where a held hybrid prefill's state is exported (its rows the decode side gets);
        -1 for every other request."""
        return len(req.prompt_ids) - 1 if req.request_id in self.state_holds else -1

    def _schedule(self) -> SchedulerOutput:
        if not self.chunked:
            out = self._schedule_prefill_first()
            if out is not None:
                return out
        budget, lp_left = self.max_tokens, self.prompt_rows
        seqs: list[Scheduled] = []
        preempted: list[Request] = []
        finished: list[Request] = []
        now = time.perf_counter()

        # A constrained row's next grammar mask needs the token still in flight: it waits.
        decodes = [r for r in self.running if to_compute(r) == 1 and not self._ends_in_flight(r)
                   and not (r.matcher is not None and r.in_flight)]
        prefills = [r for r in self.running if to_compute(r) > 1]
        propose = bool(decodes) and self.proposing(len(decodes))  # the batch-size switch (verification.py)
        for at, req in enumerate(decodes + prefills):
            if req.status != Status.RUNNING:
                continue  # preempted by an earlier request of this loop
            if budget == 0 or len(seqs) >= self.max_seqs:
                break
            n = self._chunk(req, req.num_computed, min(to_compute(req), budget))
            n, scored = self._prompt_rows_cap(req, req.num_computed, n, lp_left)
            if n == 0:
                continue  # this step's prompt_logprobs rows are taken
            draft = []
            if propose and at < len(decodes):  # proposals only from the budget the later decodes leave
                draft = self.draft_for(req, budget - n - (len(decodes) - 1 - at))
                if draft and not self._grow(req, req.num_computed + n + len(draft)):
                    draft = []  # no page for them: a plain decode, never a preemption for proposals
                if draft and not self.hold_spec_slot(req):
                    draft = []  # a hybrid without a slot to keep its state in (verification.py)
            while not self._grow(req, req.num_computed + n):
                victim = max(self.running, key=self._key)
                if victim is req and len(self.running) == 1:
                    # Cannot fit even alone: the pool is too small for this sequence.
                    self.finish(req, "length")
                    finished.append(req)
                    req = None
                    break
                for i, s in enumerate(seqs):
                    if s.req is victim:
                        budget += s.num_new
                        del seqs[i]
                        break
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    req = None
                    break
            if req is None:
                continue
            seqs.append(Scheduled(req, req.num_computed, n + len(draft), draft=draft))
            budget -= n + len(draft)
            lp_left -= scored

        if preempted:
            # Out of pages this step: admitting anyone now (the victim first of all, whose
            # pages were just freed) would only be preempted again next step.
            return SchedulerOutput(seqs, preempted, finished)
        num_partial = sum(1 for s in seqs if s.num_new < to_compute(s.req))
        i = 0
        while i < len(self.waiting) and budget > 0 and len(seqs) < self.max_seqs:
            req = self.waiting[i]
            if req.in_flight or self._waits_for_sibling(req):
                i += 1  # preempted with a token still on its way, or a sample before its prompt is cached
                continue
            hits = [] if req.pages else self.prefix.hits(req)
            computed = len(hits) * self.page_size
            remaining = req.num_tokens - computed
            n = self._chunk(req, computed, min(remaining, budget))
            n, scored = self._prompt_rows_cap(req, computed, n, lp_left)
            if n == 0:
                i += 1
                continue
            if n < remaining and num_partial >= self.max_partial:
                i += 1  # would become another partial prefill: let shorter prompts pass
                continue
            need = self.bm.pages_for(computed + n) - len(hits)
            if not self._can_admit(need, hits):
                break  # out of pages: stop admitting (running requests keep theirs)
            if self.slots_used and not self.free_slots:
                break  # every recurrent-state slot is held (linear-attention hybrids)
            self.bm.queries += len(req.page_hashes)
            del self.waiting[i]
            seqs.append(self._admit(req, hits, need, computed, n, now))
            budget -= n
            lp_left -= scored
            if n < remaining:
                num_partial += 1
        return SchedulerOutput(seqs, preempted, finished)

    @staticmethod
    def _waits_for_sibling(req: Request) -> bool:
        """An n > 1 sample waits until sample 0 has a token: its prompt pages are then in the
        prefix cache (published when the step's results came back)."""
        first = req.prefill_after
        return first is not None and first.status != Status.FINISHED and not first.output_ids

    @staticmethod
    def _prompt_rows_cap(req: Request, start: int, n: int, left: int) -> tuple[int, int]:
        """(tokens to schedule, prompt rows they score): a prompt_logprobs chunk is cut to
        the step's rows left (engine.prompt_logprobs_rows); 0 tokens when none are."""
        if req.params.prompt_logprobs is None:
            return n, 0
        scored = max(0, min(start + n, len(req.prompt_ids) - 1) - start)
        return (n, scored) if scored <= left else (left, left)

    def _ends_in_flight(self, req: Request) -> bool:
        """Async scheduling: the token in flight is its last (max_tokens / max_model_len),
        so it needs no further compute."""
        return req.in_flight > 0 and (len(req.output_ids) + req.in_flight >= req.params.max_tokens
                                      or total_tokens(req) >= self.max_model_len)

    @staticmethod
    def _fresh_pages(need: int, hits: list) -> list[int]:
        """Logical indices of an admission's fresh pages: each Restore's, then the `need` new ones."""
        return [j for j, h in enumerate(hits) if isinstance(h, Restore)] + list(range(len(hits), len(hits) + need))

    def _can_admit(self, need: int, hits: list) -> bool:
        """Whether `need` new pages, plus one per Restore, fit beside the shared hits."""
        device = [h for h in hits if not isinstance(h, Restore)]
        return self.bm.can_allocate(self._fresh_pages(need, hits), device)

    def _admit(self, req, hits: list, need: int, computed: int, n: int, now: float) -> Scheduled:
        """A waiting request starts running: device hits shared, fresh pages for its
        restores and new tokens."""
        device = [h for h in hits if not isinstance(h, Restore)]
        restores = [h for h in hits if isinstance(h, Restore)]
        self.bm.acquire(device)
        fresh = self.bm.allocate(self._fresh_pages(need, hits))
        for r, page in zip(restores, fresh):
            r.page = page
        req.pages = [h.page if isinstance(h, Restore) else h for h in hits] + fresh[len(restores):]
        if self.tier is not None:
            self.prefix.count_tier_queries(req, hits, restores)
        req.num_computed = computed
        if req.cached_tokens is None:
            req.cached_tokens = computed
            self.cached_tokens_total += computed
        if req.first_scheduled is None:
            req.first_scheduled = now
        state_from = state_host = None
        if self.slots_used:
            req.state_slot = self.free_slots.pop()
            if computed:  # resumes from a snapshot, copied into its own slot (never read in place)
                state_from, state_host = self.snapshots.source(req.page_hashes[len(hits) - 1])
            if computed and computed == self._state_export_at(req):  # held, and every row it sends was cached
                self.state_exports.append((req.request_id, req.state_slot))
        req.status = Status.RUNNING
        self.running.append(req)
        return Scheduled(req, computed, n, restores, state_from, state_host)

    def _schedule_prefill_first(self) -> SchedulerOutput | None:
        """Baseline (chunked_prefill = False): whole waiting prompts in a prefill-only step,
        decodes paused meanwhile; None when no prompt can start (then decodes run)."""
        budget, seqs, now, lp_left = self.max_tokens, [], time.perf_counter(), self.prompt_rows
        while self.waiting and len(seqs) + len(self.running) < self.max_seqs:
            req = self.waiting[0]
            if self._waits_for_sibling(req):
                break
            hits = self.prefix.hits(req)
            computed = len(hits) * self.page_size
            n = req.num_tokens - computed
            need = self.bm.pages_for(req.num_tokens) - len(hits)
            if n > budget or not self._can_admit(need, hits) or self._prompt_rows_cap(req, computed, n, lp_left)[0] < n:
                break
            self.waiting.pop(0)
            self.bm.queries += len(req.page_hashes)  # counted like the chunked path: hits never exceed queries
            seqs.append(self._admit(req, hits, need, computed, n, now))
            budget -= n
            lp_left -= self._prompt_rows_cap(req, computed, n, lp_left)[1]
        return SchedulerOutput(seqs, [], []) if seqs else None
