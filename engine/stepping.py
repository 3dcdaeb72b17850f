"""One thread steps an engine: the guard that makes a second stepper a clear error.

Two threads stepping one engine would compute the same chunk twice and race on the
donated KV cache. `claim()` wraps every step/warm-up; `own()` lets a serving loop keep
the engine for its whole life, so no other thread slips in between two of its steps.
"""

from __future__ import annotations

import contextlib
import threading


class StepGuard:
    def __init__(self, lock: threading.RLock):
        self._lock = lock  # the engine's lock, which also guards its queues
        self._stepper: int | None = None  # the thread inside step() or warmup()
        self._owner: int | None = None  # a serving loop's thread, which alone may step

    @contextlib.contextmanager
    def claim(self):
        """Refuses a second thread while one is inside step() or warmup(). The same thread is
        let in: only an interrupt landing between the claim and the `try` can leave the
        claim behind, and the next step on that thread clears it."""
        me = threading.get_ident()
        with self._lock:
            if self._owner is not None and self._owner != me:
                raise RuntimeError(
                    f"this engine is stepped by a serving loop (thread ident {self._owner}): submit work "
                    "through it, or build a second Engine for direct generate()/stream() calls")
            if self._stepper is not None and self._stepper != me:
                raise RuntimeError(
                    f"Engine.step() is already running in another thread (ident {self._stepper}): one "
                    "thread steps an engine (a serving loop, or one generate()/stream() at a time). From "
                    "other threads, add_request() / abort() and let the stepping thread run them.")
            self._stepper = me
        try:
            yield
        finally:
            self._stepper = None

    def refuse_others(self) -> None:
        """generate / stream fail before adding anything while another thread steps."""
        with self.claim():
            pass

    @contextlib.contextmanager
    def own(self):
        """While inside, only the calling thread may step."""
        with self._lock:
            if self._owner is not None:
                raise RuntimeError(f"this engine is already owned by thread ident {self._owner}")
            self._owner = threading.get_ident()
        try:
            yield
        finally:
            with self._lock:
                self._owner = None
