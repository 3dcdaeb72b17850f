"""The scheduler: the one owner of request state.

    batching.py     the token-budget schedule: admission, prefix hits, pages, preemption
    transitions.py  dispatch, step outputs, rewind, finish, prefilled admission
    replicas.py     one Scheduler per data replica, and the registry of unfinished requests
"""

from jaxfill.engine.scheduler.batching import Scheduled, Scheduler, SchedulerOutput, to_compute, total_tokens
from jaxfill.engine.scheduler.replicas import ReplicaScheduler
from jaxfill.engine.scheduler.transitions import Sampled

__all__ = ["ReplicaScheduler", "Sampled", "Scheduled", "Scheduler", "SchedulerOutput", "to_compute",
           "total_tokens"]
