"""How a step's outputs reach the event loop without the engine thread waking it.

Waking an asyncio loop from another thread (`call_soon_threadsafe`) writes to its self-pipe,
and that `send` gives up the GIL. The loop thread, just woken, takes it and runs the step's
delivery (TextStage, queues, gRPC writes for every stream), so the engine thread waited
for the GIL after every step: cProfile of the engine thread, 32 streams over gRPC on the
tiny preset, showed 260 such sends costing 1.10 s of a 4.05 s run, 4 ms each, longer
than the step (benchmarks/RESULTS.md, "Serving over gRPC"). Here the engine thread only
appends to an outbox and sets an Event (no syscall that yields the GIL); a small thread
makes the wake-up, so the engine thread goes straight on to the next step's host work and
gives the GIL up where it would anyway, waiting for the device.

Order is kept: the outbox is FIFO and one `_drain` on the loop delivers everything posted
so far, in order (several steps at once when the loop fell behind).
"""

from __future__ import annotations

import asyncio
import collections
import threading
from typing import Callable


class Poster:
    def __init__(self, loop: asyncio.AbstractEventLoop, deliver: Callable[..., None]):
        """deliver(*item) runs on `loop` for every posted item, in posting order."""
        self._loop = loop
        self._deliver = deliver
        self._outbox: collections.deque = collections.deque()
        self._posted = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="jaxfill-post", daemon=True)
        self._thread.start()

    def post(self, *item) -> None:
        """Engine thread: queue one delivery; never blocks, never yields the GIL on a syscall."""
        self._outbox.append(item)
        self._posted.set()

    def close(self, timeout: float = 5.0) -> None:
        """After the last post: what is queued is still delivered (if the loop runs)."""
        self._closing = True
        self._posted.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            self._posted.wait()
            self._posted.clear()  # a post after this sets it again; one before is in the outbox
            closing = self._closing
            if self._outbox:
                try:
                    self._loop.call_soon_threadsafe(self._drain)
                except RuntimeError:  # the event loop is closed: shutting down
                    return
            if closing:
                return

    def _drain(self) -> None:
        """Event loop: everything posted so far, in order."""
        try:
            while self._outbox:
                self._deliver(*self._outbox.popleft())
        finally:
            if self._outbox:  # a delivery raised: the rest still goes, after the loop reports it
                self._loop.call_soon(self._drain)
