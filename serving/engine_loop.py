"""One background thread owns the Engine; asyncio handlers talk to it through queues.

The Engine is not thread-safe and a step can take a while (a long prefill chunk), so
no gRPC handler ever calls it. Handlers `submit()` and `abort()`: both append to an
inbox the engine thread drains before every step, in order (an abort queued behind its
own add still finds the request). After each step the thread hands the whole batch of
outputs to the event loop with one `call_soon_threadsafe`, which fans them out to the
per-request asyncio queues. A cancelled stream's abort is applied before the next step
runs, so its pages are free within one step.

Admission: `submit()` admits while fewer than max_num_seqs x data replicas (the batch
slots) + engine.max_waiting requests are in flight, and raises QueueFull beyond. Counting
the slots means a burst fills idle slots instead of being refused for a waiting queue that
the next step would empty. The engine's own waiting limit still holds: what it refuses
stays, in order, in this thread's backlog (at most the slots) and goes in as steps make room.

Every admitted request ends exactly once on the event loop (`_end`), whatever ended it:
that is where the request metrics are observed, so a stream the client cancelled or let
pass its deadline counts as much as one that finished.

Stream items (what `RequestStream.queue` yields), each `(kind, payload, t)` with `t`
the engine-thread `time.monotonic()` when the step returned:
    ("output", RequestOutput, t)   tokens and/or the final Completion
    ("aborted", None, t)           aborted by `abort(notify=True)` (an Abort RPC, or shutdown)
    ("error", Exception, t)        add_request refused it (InvalidRequest), or the step
                                   failed as a whole

Text is made on the event loop, not the engine thread: the loop owns the engine's
stepping with `own_stepping(defer_text=True)`, so a step only records ids and the stops scheduling needs, and `_dispatch` runs each
output through a TextStage (serving/text_stage.py: detokenization, stop strings, logprob
formatting) in step order before it reaches the stream. A stop string found there goes
back through the inbox as `engine.stop_at`, applied before the next step; tokens the
engine computed past it meanwhile are dropped, never streamed.

Prefix-cache events (engine/block_manager.py's listener) are only recorded on the engine
thread; they ride the same `call_soon_threadsafe` as the step's outputs and reach each
`subscribe_kv()` queue as numbered batches
`(sequence, wall time, replica, events, first event id)`, so a
slow subscriber never holds up a step.
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
from jaxfill.serving.text_stage import TextStage

log = logging.getLogger("jaxfill.serving")

WARMING, SERVING, DRAINING, STOPPED, FAILED = "warming", "serving", "draining", "stopped", "failed"


class StepFailed(RuntimeError):
    """engine.step() raised; every request in flight at that moment fails with it."""


KV_HISTORY_BATCHES = 1024  # KV event batches kept for subscribers resuming from a sequence number
KV_SUBSCRIBER_MAX_BACKLOG = 4096  # batches a subscriber may fall behind before it is dropped


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
        self.cached_tokens = 0  # prompt tokens served from the prefix cache (set at admission)
        self.done = False
        self.gone: str | None = None  # why the handler stopped listening ("cancelled", "deadline")


class EngineLoop:
    def __init__(self, engine, metrics=None, idle_wait_s: float = 0.5):
        self.engine = engine
        self.metrics = metrics
        self.idle_wait_s = idle_wait_s
        self.state = WARMING
        self.error: BaseException | None = None
        cfg = engine.config
        self.max_waiting = cfg.engine.max_waiting
        self.batch_slots = cfg.engine.max_num_seqs * cfg.mesh.data
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._streams: dict[str, RequestStream] = {}  # event-loop side only: admitted, not yet ended
        self._in_engine: dict[str, RequestStream] = {}  # engine-thread side only
        self._backlog: collections.deque = collections.deque()  # engine thread: adds the engine refused (full)
        self._stats: dict = dict(engine.stats())
        if metrics is not None:
            metrics.update_stats(self._stats)  # the baseline engine counters are counted from
        self._ready_callbacks: list[Callable[[], Any]] = []
        # request id -> admit(engine, ids, params, id, priority), used instead of add_request
        # (disaggregated prefill: hold the pages, or admit pulled KV; serving/disagg.py)
        self.admit_hooks: dict[str, Callable] = {}
        self._text = TextStage(engine.tokenizer)  # event-loop side only
        self.steps = 0
        self.warmup_s = 0.0
        self._kv_pending: list = []  # engine thread: (replica, event) since the last post
        self._kv_subscribers: set[asyncio.Queue] = set()  # event-loop side
        self._kv_history: collections.deque = collections.deque(maxlen=KV_HISTORY_BATCHES)
        self.kv_sequence = 0  # the last KV event batch's number (event-loop side)
        self._kv_events_published = 0  # events are numbered from 1 across batches

    # ------------------------------------------------------------------ lifecycle
    def start(self, loop: asyncio.AbstractEventLoop, warmup: bool = True,
              on_ready: Callable[[], Any] | None = None) -> None:
        self._loop = loop
        self.engine.set_kv_event_listener(self._on_kv_event)
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
    def capacity(self) -> int:
        """Requests admitted at once: every batch slot, plus engine.max_waiting that wait."""
        return self.batch_slots + self.max_waiting

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

        Raises InvalidRequest for a request id already in flight and QueueFull when
        `capacity` requests are in flight.
        """
        if request_id in self._streams:
            raise InvalidRequest("request_id", f"{request_id!r} is already in flight")
        if len(self._streams) >= self.capacity:
            raise QueueFull(f"server is full: {len(self._streams)} requests in flight fill the "
                            f"{self.batch_slots} batch slots and {self.max_waiting} waiting places "
                            "(engine.max_num_seqs, engine.max_waiting); retry later")
        stream = RequestStream(request_id, len(prompt_ids), arrival or time.monotonic())
        try:
            self._text.start(request_id, prompt_ids, params)
        except Exception:  # noqa: BLE001 - ids the tokenizer cannot prime on: add_request refuses them
            pass
        self._streams[request_id] = stream
        self._inbox.append(("add", stream, prompt_ids, params, priority))
        self._wake.set()
        return stream

    def abort(self, request_id: str, notify: bool = False, reason: str = "cancelled") -> bool:
        """Aborts a request. notify=True (Abort RPC, shutdown): its stream gets an "aborted"
        item. notify=False: its handler has stopped listening, for `reason`; the stream gets
        nothing more and ends (metrics included) once the engine has let go of it."""
        stream = self._streams.get(request_id)
        if stream is None or stream.gone:
            return False
        if not notify:
            stream.gone = reason
        self._inbox.append(("abort", stream))
        self._wake.set()
        return True

    def call_on_engine(self, fn: Callable[[], Any]) -> None:
        """Runs fn() on the engine thread before the next step (the stats are published after)."""
        self._inbox.append(("call", fn))
        self._wake.set()

    def abort_all(self) -> int:
        ids = [rid for rid, s in self._streams.items() if not s.gone]
        for rid in ids:
            self.abort(rid, notify=True)
        return len(ids)

    def subscribe_kv(self, start_sequence: int = 0) -> asyncio.Queue:
        """A queue of KV event batches from now on (and, for start_sequence > 0, the kept
        batches numbered from it). A None item means the subscriber fell too far behind."""
        q: asyncio.Queue = asyncio.Queue()
        if start_sequence > 0:
            for batch in self._kv_history:
                if batch[0] >= start_sequence:
                    q.put_nowait(batch)
        self._kv_subscribers.add(q)
        return q

    def unsubscribe_kv(self, q: asyncio.Queue) -> None:
        self._kv_subscribers.discard(q)

    def _publish_kv(self, events: list) -> None:
        by_replica: dict[int, list] = {}
        for replica, event in events:
            by_replica.setdefault(replica, []).append(event)
        for replica, evs in sorted(by_replica.items()):
            self.kv_sequence += 1
            batch = (self.kv_sequence, time.time(), replica, evs, self._kv_events_published + 1)
            self._kv_events_published += len(evs)
            self._kv_history.append(batch)
            for q in list(self._kv_subscribers):
                if q.qsize() >= KV_SUBSCRIBER_MAX_BACKLOG:
                    self._kv_subscribers.discard(q)
                    q.put_nowait(None)
                else:
                    q.put_nowait(batch)

    def _dispatch(self, items: list, stats: dict | None, kv_events: list | None = None) -> None:
        """Event-loop side of one step: route outputs to their streams, KV events to subscribers."""
        if stats is not None:
            self._stats = stats
        if kv_events:
            self._publish_kv(kv_events)
        for kind, stream, payload, t in items:
            if stream.done:
                continue
            finished = True
            if kind == "output":
                payload, stop_at = self._text.render(payload)
                if payload is None:
                    continue  # computed past a stop string: never streamed
                if stop_at is not None:  # the engine finishes it before its next step
                    self._inbox.append(("stop", stream, stop_at))
                    self._wake.set()
                if self.metrics is not None and payload.new_token_ids:
                    self.metrics.generation_tokens.inc(len(payload.new_token_ids))
                if payload.new_token_ids:
                    if stream.first_token_t is None:
                        stream.first_token_t = t
                    elif self.metrics is not None and stream.last_token_t is not None and not stream.gone:
                        self.metrics.itl.observe(max(t - stream.last_token_t, 0.0))
                    stream.last_token_t = t
                    stream.num_tokens += len(payload.new_token_ids)
                finished = payload.finished
            if finished:
                self._end(stream, kind, payload, t)
            if not stream.gone:
                stream.queue.put_nowait((kind, payload, t))

    def _end(self, stream: RequestStream, kind: str, payload, t: float) -> None:
        """The one place an admitted request ends: frees its id and observes its metrics."""
        stream.done = True
        self._text.drop(stream.request_id)
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
        if self.metrics is None:
            return
        completion = payload.completion if kind == "output" else None
        if stream.gone:
            reason = stream.gone
        elif kind == "output":
            reason = completion.finish_reason if completion is not None else "stop"
        else:
            reason = "abort" if kind == "aborted" else "error"
        m = (completion.metrics or {}) if completion is not None else {}
        ttft = stream.first_token_t - stream.arrival if stream.first_token_t is not None else None
        tpot = None
        if stream.num_tokens > 1:
            tpot = (stream.last_token_t - stream.first_token_t) / (stream.num_tokens - 1)
        self.metrics.observe_finished(
            reason=reason, prompt_tokens=stream.prompt_tokens, completion_tokens=stream.num_tokens,
            ttft_s=ttft, tpot_s=tpot, queue_s=m.get("queue_s"), prefill_s=m.get("prefill_s"),
            e2e_s=t - stream.arrival)

    # ------------------------------------------------------------- engine thread
    def _on_kv_event(self, replica: int, *event) -> None:
        """The block managers' listener: records only (engine thread, inside the step)."""
        self._kv_pending.append((replica, event))

    def _post(self, items: list, stats: dict | None = None) -> None:
        kv_events, self._kv_pending = self._kv_pending, []
        if items or stats is not None or kv_events:
            try:
                self._loop.call_soon_threadsafe(self._dispatch, items, stats, kv_events)
            except RuntimeError:  # event loop closed: shutting down
                pass

    def _run(self, warmup: bool) -> None:
        try:
            # No other thread steps the engine while we serve, and text is made on the event loop.
            with self.engine.own_stepping(defer_text=True):
                self._serve(warmup)
        except RuntimeError as e:  # the engine is already owned by another loop
            log.error("%s", e)
            self.error = e
            self.state = FAILED

    def _serve(self, warmup: bool) -> None:
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
        """Applies the queued adds and aborts in order, then hands the engine what it takes."""
        items = []
        while self._inbox:
            op = self._inbox.popleft()
            if op[0] == "add":
                self._backlog.append(op)
                continue
            if op[0] == "call":  # call_on_engine (serving/disagg.py: release or expire held KV pages)
                self._quietly(op[1])
                continue
            if op[0] == "stop":  # a stop string ended it (found by the TextStage)
                if self._in_engine.get(op[1].request_id) is op[1]:
                    self.engine.stop_at(op[1].request_id, op[2])
                continue
            stream = op[1]
            rid = stream.request_id
            if self._in_engine.get(rid) is stream:
                del self._in_engine[rid]
                try:
                    self.engine.abort(rid)
                except Exception:  # noqa: BLE001
                    log.error("abort(%s) failed:\n%s", rid, traceback.format_exc())
            else:
                self._backlog = collections.deque(a for a in self._backlog if a[1] is not stream)
            items.append(("aborted", stream, None, time.monotonic()))  # ignored if it ended first
        while self._backlog:
            _, stream, prompt_ids, params, priority = self._backlog[0]
            try:
                admit = self.admit_hooks.get(stream.request_id)  # serving/disagg.py
                if admit is not None:
                    admit(self.engine, prompt_ids, params, stream.request_id, priority)
                else:
                    self.engine.add_request(prompt_ids, params, request_id=stream.request_id, priority=priority)
                self._in_engine[stream.request_id] = stream
            except QueueFull:
                break  # the engine is full: the rest (hooks kept) goes in as steps empty it
            except InvalidRequest as e:
                items.append(("error", stream, e, time.monotonic()))
            except Exception as e:  # noqa: BLE001 - one bad request must not stop the loop
                log.error("add_request(%s) failed:\n%s", stream.request_id, traceback.format_exc())
                items.append(("error", stream, StepFailed(f"add_request failed: {e}"), time.monotonic()))
            self.admit_hooks.pop(stream.request_id, None)
            self._backlog.popleft()
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
            for rid, stream in list(self._in_engine.items()):
                try:
                    self.engine.abort(rid)
                except Exception:  # noqa: BLE001
                    pass
                items.append(("error", stream, StepFailed(f"engine step failed: {e}"), now))
            self._in_engine.clear()
            return items
        now = time.monotonic()
        self.steps += 1
        items = []
        for out in outputs:
            stream = self._in_engine.get(out.request_id)
            if stream is None:
                continue  # the "abort" output of a request already reported as aborted
            cached = out.num_cached_tokens if out.completion is None else out.completion.cached_tokens
            if cached:
                stream.cached_tokens = cached
            if out.finished:
                del self._in_engine[out.request_id]
            items.append(("output", stream, out, now))
        return items
