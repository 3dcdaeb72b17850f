"""The scheduler: the one owner of request state.

    batching.py       the token-budget schedule: admission, pages, preemption
    step_plan.py      what schedule() returns: Scheduled rows, Restores, SchedulerOutput
    prefix_lookup.py  prefix-cache hits (device and host tier), computed pages published
    transitions.py    dispatch, step outputs, rewind, finish, prefilled admission
    replicas.py       one Scheduler per data replica, and the registry of unfinished requests
"""

from jaxfill.engine.scheduler.batching import Scheduler
from jaxfill.engine.scheduler.step_plan import Scheduled, SchedulerOutput, to_compute, total_tokens
from jaxfill.engine.scheduler.replicas import ReplicaScheduler
from jaxfill.engine.scheduler.transitions import Sampled

__all__ = ["ReplicaScheduler", "Sampled", "Scheduled", "Scheduler", "SchedulerOutput", "to_compute",
           "total_tokens"]
