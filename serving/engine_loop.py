"""One background thread owns the Engine; asyncio handlers talk to it through queues.

The Engine is not thread-safe and a step can take a while (a long prefill chunk), so
no gRPC handler ever calls it. Handlers `submit()` and `abort()`: both append to an
inbox the engine thread drains before every step, in order (an abort queued behind its
own add still finds the request). After each step the thread hands the whole batch of
outputs to the event loop with one `call_soon_threadsafe`, which fans them out to the
per-request asyncio queues. A cancelled stream's abort is applied before the next step
runs, so its pages are free within one step.

Stream items (what `RequestStream.queue` yields), each `(kind, payload, t)` with `t`
the engine-thread `time.monotonic()` when the step returned:
    ("output", RequestOutput, t)   tokens and/or the final Completion
    ("aborted", None, t)           aborted by `abort()` (an Abort RPC, or shutdown)
    ("error", Exception, t)        add_request refused it (InvalidRequest, QueueFull), or
                                   the step failed as a whole
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import traceback
from typing import Any, Callable

from jaxfill.engine.request import InvalidRequest, QueueFull, RequestOutput, SamplingParams

log = logging.getLogger("jaxfill.serving")

WARMING, SERVING, DRAINING, STOPPED, FAILED = "warming", "serving", "draining", "stopped", "failed"


class StepFailed(RuntimeError):
    """engine.step() raised; every request in flight at that moment fails with it."""


class RequestStream:
    """The asyncio side of one request: its queue and the timestamps metrics need."""

    def __init__(self, request_id: str, prompt_tokens: int, arrival: float):
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.arrival = arrival  # time.monotonic() when the handler received it
        self.queue: asyncio.Queue = asyncio.Queue()
        self.first_token_t: float | None = None
        self.last_token_t: float | None = None
        self.num_tokens = 0
        self.done = False


class EngineLoop:
    def __init__(self, engine, metrics=None, idle_wait_s: float = 0.5):
        self.engine = engine
        self.metrics = metrics
        self.idle_wait_s = idle_wait_s
        self.state = WARMING
        self.error: BaseException | None = None
        self.max_waiting = engine.config.engine.max_waiting
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._streams: dict[str, RequestStream] = {}  # event-loop side only
        self._pending_adds = 0  # submitted, not yet handed to the engine (event-loop side count)
        self._in_engine: set[str] = set()  # engine-thread side only
        self._stats: dict = dict(engine.stats())
        self._ready_callbacks: list[Callable[[], Any]] = []
        self.steps = 0
        self.warmup_s = 0.0

    # ------------------------------------------------------------------ lifecycle
    def start(self, loop: asyncio.AbstractEventLoop, warmup: bool = True,
              on_ready: Callable[[], Any] | None = None) -> None:
        self._loop = loop
        if on_ready:
            self._ready_callbacks.append(on_ready)
        self._thread = threading.Thread(target=self._run, args=(warmup,), name="jaxfill-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.state != FAILED:
            self.state = STOPPED

    def begin_drain(self) -> None:
        if self.state in (WARMING, SERVING):
            self.state = DRAINING

    @property
    def num_active(self) -> int:
        return len(self._streams)

    def stats(self) -> dict:
        """The engine's stats() as of the last step (or the last inbox drain when idle)."""
        return dict(self._stats)

    # ------------------------------------------------------------ event-loop API
    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
               priority: int = 0, arrival: float | None = None) -> RequestStream:
        """Queues a request for the engine thread. Runs on the event loop.

        Raises InvalidRequest for a request id already in flight and QueueFull when the
        waiting queue (engine waiting + not yet handed over) is at engine.max_waiting.
        """
        if request_id in self._streams:
            raise InvalidRequest("request_id", f"{request_id!r} is already in flight")
        if self._pending_adds + self._stats.get("num_waiting", 0) >= self.max_waiting:
            raise QueueFull(f"waiting queue is full ({self.max_waiting} requests)")
        stream = RequestStream(request_id, len(prompt_ids), arrival or time.monotonic())
        self._streams[request_id] = stream
        self._pending_adds += 1
        self._inbox.append(("add", request_id, prompt_ids, params, priority))
        self._wake.set()
        return stream

    def abort(self, request_id: str, notify: bool = False) -> bool:
        """Aborts a request. With notify=False (the handler itself gave up) the stream is
        dropped at once; with notify=True (Abort RPC, shutdown) it gets an "aborted" item."""
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        if not notify:
            self._streams.pop(request_id, None)
            stream.done = True
        self._inbox.append(("abort", request_id, notify))
        self._wake.set()
        return True

    def abort_all(self) -> int:
        ids = list(self._streams)
        for rid in ids:
            self.abort(rid, notify=True)
        return len(ids)

    def _dispatch(self, items: list, stats: dict | None) -> None:
        """Event-loop side of one step: route outputs to their streams."""
        if stats is not None:
            self._stats = stats
        for kind, rid, payload, t in items:
            if kind == "added":
                self._pending_adds -= 1
                continue
            stream = self._streams.get(rid)
            if stream is None or stream.done:
                continue
            if kind == "output":
                if payload.new_token_ids:
                    if stream.first_token_t is None:
                        stream.first_token_t = t
                    elif self.metrics is not None and stream.last_token_t is not None:
                        self.metrics.itl.observe(max(t - stream.last_token_t, 0.0))
                    stream.last_token_t = t
                    stream.num_tokens += len(payload.new_token_ids)
                finished = payload.finished
            else:
                finished = True
            if finished:
                stream.done = True
                del self._streams[rid]
            stream.queue.put_nowait((kind, payload, t))

    # ------------------------------------------------------------- engine thread
    def _post(self, items: list, stats: dict | None = None) -> None:
        if items or stats is not None:
            try:
                self._loop.call_soon_threadsafe(self._dispatch, items, stats)
            except RuntimeError:  # event loop closed: shutting down
                pass

    def _run(self, warmup: bool) -> None:
        try:
            if warmup and not self.engine.warmed_up:
                start = time.monotonic()
                self.engine.warmup()
                self.warmup_s = time.monotonic() - start
            if self.state == WARMING:
                self.state = SERVING
            for cb in self._ready_callbacks:
                self._loop.call_soon_threadsafe(cb)
        except BaseException as e:  # noqa: BLE001 - reported through health / logs
            log.error("warm-up failed:\n%s", traceback.format_exc())
            self.error = e
            self.state = FAILED
            self._quietly(self.engine.close)
            return
        while not self._stop.is_set():
            had_ops = bool(self._inbox)
            items = self._drain_inbox()
            if self.engine.has_unfinished():
                items += self._step()
                self._post(items, self._snapshot())
            else:
                if had_ops:  # aborts free pages without a step: publish the new stats
                    self._post(items, self._snapshot())
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
                self._quietly(self.engine.idle)  # multi-process: a heartbeat to the followers now and then
        self._quietly(self.engine.close)  # multi-process: release the followers

    @staticmethod
    def _quietly(fn) -> None:
        """Engine.idle / Engine.close: a failure is logged, never raised into the loop."""
        try:
            fn()
        except Exception:  # noqa: BLE001
            log.error("engine.%s() failed:\n%s", fn.__name__, traceback.format_exc())

    def _snapshot(self) -> dict:
        stats = dict(self.engine.stats())
        if self.metrics is not None:
            self.metrics.update_stats(stats)
        return stats

    def _drain_inbox(self) -> list:
        items = []
        while self._inbox:
            op = self._inbox.popleft()
            now = time.monotonic()
            if op[0] == "add":
                _, rid, prompt_ids, params, priority = op
                items.append(("added", rid, None, now))
                try:
                    self.engine.add_request(prompt_ids, params, request_id=rid, priority=priority)
                    self._in_engine.add(rid)
                except (InvalidRequest, QueueFull) as e:
                    items.append(("error", rid, e, now))
                except Exception as e:  # noqa: BLE001 - one bad request must not stop the loop
                    log.error("add_request(%s) failed:\n%s", rid, traceback.format_exc())
                    items.append(("error", rid, StepFailed(f"add_request failed: {e}"), now))
            else:
                _, rid, notify = op
                if rid in self._in_engine:
                    self._in_engine.discard(rid)
                    try:
                        self.engine.abort(rid)
                    except Exception:  # noqa: BLE001
                        log.error("abort(%s) failed:\n%s", rid, traceback.format_exc())
                if notify:
                    items.append(("aborted", rid, None, now))
        return items

    def _step(self) -> list:
        try:
            outputs: list[RequestOutput] = self.engine.step()
        except Exception as e:  # noqa: BLE001
            # The step as a whole failed: fail everything in flight, keep the loop alive.
            log.error("engine.step() failed; failing %d requests:\n%s", len(self._in_engine),
                      traceback.format_exc())
            now = time.monotonic()
            items = []
            for rid in list(self._in_engine):
                try:
                    self.engine.abort(rid)
                except Exception:  # noqa: BLE001
                    pass
                items.append(("error", rid, StepFailed(f"engine step failed: {e}"), now))
            self._in_engine.clear()
            return items
        now = time.monotonic()
        self.steps += 1
        items = []
        gen_tokens = 0
        for out in outputs:
            gen_tokens += len(out.new_token_ids)
            if out.finished:
                self._in_engine.discard(out.request_id)
            items.append(("output", out.request_id, out, now))
        if self.metrics is not None and gen_tokens:
            self.metrics.generation_tokens.inc(gen_tokens)
        return items
