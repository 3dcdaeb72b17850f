"""Before a step: the host tier's pages (and a hybrid's state snapshot) written back into
the device pages (and the request's own state slot) the scheduler gave the rows that hit
there (engine/step_phases.py `restore` calls it under the lock, before the batch is built).

A request whose blocks could not be read or written recomputes instead (never wrong K/V)
and its blocks leave the tier; so does one whose snapshot left the tier meanwhile (never a
state that is not its prefix's). The scheduler hears every row's outcome (`restored`).
"""

from __future__ import annotations

import sys
import traceback

from jaxfill.models.linear_state import state_row


def restore_rows(runner, scheduler, scheds) -> bool:
    """[lock] Restores every row of `scheds` (SchedulerOutput per replica) that needs it.
    True: all of them held (or none needed it). False: the rows that failed are taken out
    of their SchedulerOutput's seqs, and the cache may be lost (runner.cache_ok())."""
    rows = [sch for sc in scheds for sch in sc.seqs if sch.restores or sch.state_host is not None]
    if not rows:
        return True
    paged = [(sch.req.replica, r.page, r.hash) for sch in rows for r in sch.restores]
    try:
        failed = runner.restore(paged) if paged else set()
    except Exception:  # noqa: BLE001 - the requests recompute; the engine goes on
        traceback.print_exc(file=sys.stderr)
        failed = None
    bad = {id(sch) for sch in rows if failed is None or any(r.hash in failed for r in sch.restores)}
    for sch in rows:
        if id(sch) in bad:
            runner.kv_offload.discard(r.hash for r in sch.restores)
    bad |= restore_states(runner, [sch for sch in rows if id(sch) not in bad])
    for sch in rows:
        scheduler.restored(sch, ok=id(sch) not in bad)
    if not bad:
        return True
    for sc in scheds:
        sc.seqs = [sch for sch in sc.seqs if id(sch) not in bad]
    return False


def restore_states(runner, rows: list) -> set[int]:
    """[lock] Hybrids: the host tier's snapshots written into their requests' own slots;
    the id() of each row whose snapshot is gone from the tier or failed to write."""
    bad = set()
    for sch in (sch for sch in rows if sch.state_host is not None):
        try:
            row = state_row(runner.config.engine.state_pool_slots, sch.req.replica, sch.req.state_slot)
            ok = runner.restore_state(sch.state_host, row)
        except Exception:  # noqa: BLE001 - the request recomputes
            traceback.print_exc(file=sys.stderr)
            ok = False
        if not ok:
            bad.add(id(sch))
    return bad
