"""Data replicas on the host (engine/scheduler/replicas.py), no model: placement by prefix hit then
load, a request's pages stay in its replica's pool, budgets are per replica."""

import random

from jaxfill.engine.scheduler import ReplicaScheduler
from test_scheduler import fake_step, mk, settings


def run_to_end(rs: ReplicaScheduler, limit=500):
    for _ in range(limit):
        if not any(s.has_work() for s in rs.replicas):
            return
        for sched, out in zip(rs.replicas, rs.schedule()):
            fake_step(sched, out)
    raise AssertionError("did not finish")


def test_new_requests_go_to_the_least_loaded_replica():
    rs = ReplicaScheduler(settings(), 3)
    reqs = [mk(10) for _ in range(7)]
    for r in reqs:
        rs.add(r)
    assert [r.replica for r in reqs] == [0, 1, 2, 0, 1, 2, 0]
    assert rs.stats()["requests_per_replica"] == [3, 2, 2]
    assert rs.num_waiting() == 7


def test_a_cached_prefix_pulls_the_request_to_its_replica():
    rs = ReplicaScheduler(settings(), 2)
    shared = [random.randrange(300) for _ in range(24)]
    first, other = mk(0, tokens=shared + [1, 2]), mk(10)
    rs.add(other)
    rs.add(first)
    assert (other.replica, first.replica) == (0, 1)
    run_to_end(rs)
    gone, busy = mk(10), mk(10)
    rs.add(gone)
    rs.add(busy)
    rs.finish(gone, "abort")
    assert (gone.replica, busy.replica) == (0, 1)  # replica 1 is now the busier one ...
    again = mk(0, tokens=shared + [3, 4])
    rs.add(again)  # ... but replica 1 has the 24-token prefix cached (6 pages)
    assert again.replica == 1
    run_to_end(rs)
    assert again.cached_tokens == 24


def test_each_replica_schedules_its_own_pool_and_budget():
    rs = ReplicaScheduler(settings(num_pages=16, max_num_batched_tokens=16), 2)
    reqs = [mk(30, max_tokens=3) for _ in range(4)]
    for r in reqs:
        rs.add(r)
    outs = rs.schedule()
    assert len(outs) == 2 and all(o.num_tokens == 16 for o in outs)  # both spend a full budget
    for replica, out in enumerate(outs):
        assert all(s.req.replica == replica for s in out.seqs)
    # Page ids are local to each pool: the two replicas hand out the same ids.
    assert outs[0].seqs[0].req.pages == outs[1].seqs[0].req.pages
    for sched, out in zip(rs.replicas, outs):
        fake_step(sched, out)
    run_to_end(rs)
    st = rs.stats()
    assert st["pages_free"] == st["pages_total"] == 2 * 15
    for sched in rs.replicas:
        sched.bm.check()


def test_recompute_all_sends_every_running_request_back():
    rs = ReplicaScheduler(settings(), 2)
    reqs = [mk(8) for _ in range(4)]
    for r in reqs:
        rs.add(r)
    for sched, out in zip(rs.replicas, rs.schedule()):
        fake_step(sched, out)
    assert len(rs.running) == 4
    rs.recompute_all()
    assert not rs.running and rs.num_waiting() == 4
    assert all(r.num_computed == 0 and r.pages == [] for r in reqs)
    assert [r.replica for r in rs.waiting] == [0, 0, 1, 1]
