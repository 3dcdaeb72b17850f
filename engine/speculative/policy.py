"""When speculation is worth proposing at all: the batch-size switch and per-request backoff.

Proposals only pay when verifying them is cheaper than the tokens they save. Two things
make them not pay, and each has its own switch (config keys under speculative.*):

* A large decode batch. Every proposal is one more row of the step; once the running
  decodes alone fill the hardware (compute-bound matmuls on a CPU, a large batch on an
  accelerator), k more rows per decode cost nearly k times the step and save at most
  their acceptance. `disable_by_batch_size` (vLLM's name): a step whose running decode
  count reaches it carries no proposals, so it runs the very program the engine uses
  without speculation.
* Text that does not repeat. Prompt lookup still finds short n-grams in prose ("of the")
  whose continuations are mostly wrong, and most decodes find no match at all, yet each
  costs a synchronous step (proposals need the newest token on the host). A request whose
  last `backoff_window` attempts (verifications, and searches that found nothing, counted
  as k rejected proposals) accepted under `backoff_min_acceptance` of their proposals
  stops proposing for `backoff_steps` of its decode steps, doubling (up to
  `backoff_max_steps`) each time it backs off again, and back to `backoff_steps` after a
  window that passes. Backed off it costs nothing: no n-gram search, and while no running
  request may propose the engine overlaps steps again (async scheduling, engine/core.py).

Neither decision touches what is emitted (acceptance.py): output is the same whatever the
policy decides, only the number of steps changes.
"""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass
class Backoff:
    """One request's recent verifications and its backoff (Request.spec_backoff)."""

    recent: collections.deque  # (proposed, accepted) of its last backoff_window verifications
    skip: int = 0  # decode steps left without proposals
    next_skip: int = 0  # the length of its next backoff
    backed_off: bool = False  # ever (spec_backoff_requests counts requests once)


@dataclasses.dataclass
class PolicyCounters:
    """What the policy turned off since start (Engine.stats(), names containing spec)."""

    disabled_steps: int = 0  # steps with decodes that the batch-size switch kept proposal-free
    backoffs: int = 0  # backoffs started (a request may back off several times)
    backoff_requests: int = 0  # requests that backed off at least once
    backoff_skipped: int = 0  # decode steps a backed-off request ran without proposals

    @staticmethod
    def total(counters: list["PolicyCounters"]) -> "PolicyCounters":
        return PolicyCounters(*(sum(getattr(c, f.name) for c in counters) for f in dataclasses.fields(PolicyCounters)))

    def stats(self) -> dict:
        return {"spec_disabled_steps": self.disabled_steps, "spec_backoffs": self.backoffs,
                "spec_backoff_requests": self.backoff_requests, "spec_backoff_skipped_decodes": self.backoff_skipped}


class SpecPolicy:
    """One scheduler's policy; `settings` is the config's SpeculativeSettings."""

    def __init__(self, settings):
        self.settings = settings
        self.counters = PolicyCounters()

    def step_allows(self, num_decodes: int) -> bool:
        """Whether this step may carry proposals, given its running decode count."""
        limit = self.settings.disable_by_batch_size
        if limit and num_decodes >= limit:
            self.counters.disabled_steps += 1
            return False
        return True

    def would_propose(self, running: list) -> bool:
        """Whether a step of these running requests may carry proposals (no counters move):
        under the batch-size limit and with one of them not backing off."""
        limit = self.settings.disable_by_batch_size
        if not running or (limit and len(running) >= limit):
            return False
        return any(r.spec_backoff is None or r.spec_backoff.skip <= 0 for r in running)

    def may_propose(self, req) -> bool:
        """Whether `req` proposes this step; a backed-off request spends one step of its backoff."""
        b = req.spec_backoff
        if b is None or b.skip <= 0:
            return True
        b.skip -= 1
        self.counters.backoff_skipped += 1
        return False

    def record_miss(self, req, k: int) -> None:
        """A decode that searched and found no n-gram: to the window, k proposals none accepted.
        Text that never repeats backs off like text whose proposals fail, so its steps go
        back to overlapping (async scheduling) instead of waiting for each token."""
        self.record(req, k, 0)

    def record(self, req, proposed: int, accepted: int) -> None:
        """One verification of `req`: back off when its window's acceptance is too low."""
        sp = self.settings
        if sp.backoff_window <= 0 or proposed <= 0:
            return
        if req.spec_backoff is None:
            req.spec_backoff = Backoff(collections.deque(maxlen=sp.backoff_window), next_skip=sp.backoff_steps)
        b = req.spec_backoff
        b.recent.append((proposed, accepted))
        if len(b.recent) < sp.backoff_window:
            return
        total_proposed = sum(p for p, _ in b.recent)
        total_accepted = sum(a for _, a in b.recent)
        if total_accepted >= sp.backoff_min_acceptance * total_proposed:
            b.next_skip = sp.backoff_steps  # a window that pays: the next backoff starts short again
            return
        b.skip = b.next_skip
        b.next_skip = min(2 * b.next_skip, sp.backoff_max_steps)
        b.recent.clear()  # after the backoff it proposes a fresh window before it is judged
        self.counters.backoffs += 1
        if not b.backed_off:
            b.backed_off = True
            self.counters.backoff_requests += 1
