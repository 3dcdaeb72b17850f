"""The Engine across processes (jax.distributed): process 0 owns the scheduler and drives
it; the others call `follow()` and run each step it broadcasts (engine/lockstep.py) until
process 0 calls `close()`:

    with Engine.from_config(cfg) as engine:
        if engine.is_leader:
            completions = engine.generate(prompts)
        else:
            engine.follow()

A mixin of Engine: it reads only `self.runner`.
"""

from __future__ import annotations


class MultiProcessFacade:
    @property
    def is_leader(self) -> bool:
        """Process 0 of a multi-process run (or the only process): owns the scheduler."""
        return self.runner.is_leader

    def _leader_only(self, what: str) -> None:
        if not self.is_leader:
            raise RuntimeError(f"{what}() runs on process 0 only: process 0 owns the scheduler; "
                               "other processes call engine.follow()")

    def follow(self) -> int:
        """Processes 1..N-1: run process 0's steps (warm-up included) until it calls close()."""
        return self.runner.follow()

    def idle(self) -> None:
        """Call when there is nothing to step (the serving loop does): keeps followers alive."""
        self.runner.idle()

    def close(self) -> None:
        """Process 0: releases the followers. A no-op in a single-process run; idempotent."""
        self.runner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
