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

An interrupt between dispatch and take leaves tokens the host will never see: `rewind`
sends every request of the lost steps back to recompute from what the host knows.
"""

from __future__ import annotations

import dataclasses

from jaxfill.engine.request import Status


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


def mark_in_flight(launch: Launch) -> None:
    """[engine lock] The step was dispatched: its requests advance optimistically."""
    for sch, row in launch.rows():
        req = sch.req
        if req.status != Status.RUNNING:
            continue
        req.num_computed = sch.start + sch.num_new
        if sch.samples:
            req.in_flight += 1
            req.pending_row = row


def rewind(launches: list[Launch], done: set) -> None:
    """[engine lock] These steps' results are lost (rows whose id is in `done` were taken):
    their requests recompute from the tokens the host knows."""
    for launch in launches:
        for sch, _ in launch.rows():
            req = sch.req
            req.in_flight = 0
            req.pending_row = -1
            if id(sch) not in done and req.status == Status.RUNNING:
                req.num_computed = min(req.num_computed, sch.start)
