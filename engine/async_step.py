"""Async scheduling's bookkeeping: one step in flight while the next is scheduled.

    step() k:   schedule + build N+1 -> dispatch N+1 -> take N's tokens (N+1 runs meanwhile)

When step N is dispatched its requests move on as if it had already finished:
`num_computed` covers the chunk, and a chunk that samples leaves `in_flight` = 1 and
`pending_row` = the token's row in N's output. The scheduler counts in-flight tokens
(scheduler.total_tokens), so N+1 can schedule that request's next decode; build_batch
gives it a placeholder and `prev_src` = pending_row, and the jitted step reads the token
from N's output on the device. The host learns N's tokens one step late; a request that
stopped on one of them may already have one more token computed in N+1: that row is
dropped when N+1 is taken (the request is finished by then), and its pages were freed
with the request.

The request-state half lives in the scheduler (engine/scheduler/transitions.py):
`on_dispatch` when a step leaves, `update_from_output` per row when it comes back, and
`rewind` when an interrupt between the two leaves tokens the host will never see.
"""

from __future__ import annotations

import dataclasses

@dataclasses.dataclass
class Launch:
    scheds: list  # SchedulerOutput per data replica
    shape: tuple[int, int]  # (T, S) bucket
    batch: object  # StepBatch (host numpy)
    pending: object = None  # runner.PendingOutput once dispatched

    def rows(self):
        """(Scheduled, its row in the step's output), replica-major."""
        for replica, sched in enumerate(self.scheds):
            for i, sch in enumerate(sched.seqs):
                yield sch, replica * self.shape[1] + i

    def scheduled(self):
        return [sch for sched in self.scheds for sch in sched.seqs]

    def has_proposals(self) -> bool:
        """Speculative decoding: a step verifying proposals is taken at once (engine/core.py)."""
        return any(sch.draft for sch in self.scheduled())
