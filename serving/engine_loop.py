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

The engine-thread half (inbox, backlog, steps) is serving/engine_thread.py; prefix-cache
events go through serving/kv_events.py.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from typing import Any, Callable

from jaxfill.engine.request import InvalidRequest, PoolingParams, QueueFull, SamplingParams
from jaxfill.serving.engine_thread import (DRAINING, FAILED, SERVING, STOPPED, WARMING, Abort, Add, Call,  # noqa: F401
                                           EngineThread, StopAt)
from jaxfill.serving.kv_events import KVEventBus
from jaxfill.serving.text_stage import TextStage


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


class EngineLoop(EngineThread):
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
        self.kv_events = KVEventBus()

    # ------------------------------------------------------------------ lifecycle
    def start(self, loop: asyncio.AbstractEventLoop, warmup: bool = True,
              on_ready: Callable[[], Any] | None = None) -> None:
        self._loop = loop
        self.engine.set_kv_event_listener(self.kv_events.record)
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
               priority: int = 0, arrival: float | None = None, after: str | None = None,
               replica: int | None = None) -> RequestStream:
        """Queues a request for the engine thread. Runs on the event loop. replica: the data
        replica it runs on (data_parallel_rank), None to let the engine place it.

        Raises InvalidRequest for a request id already in flight and QueueFull when
        `capacity` requests are in flight.
        """
        stream = self._new_stream(request_id, len(prompt_ids), arrival)
        try:
            self._text.start(request_id, prompt_ids, params)
        except Exception:  # noqa: BLE001 - ids the tokenizer cannot prime on: add_request refuses them
            pass
        self._streams[request_id] = stream
        self._inbox.append(Add(stream, prompt_ids, params, priority, after, replica=replica))
        self._wake.set()
        return stream

    def submit_pooling(self, prompt_ids: list[int], pooling: PoolingParams, request_id: str,
                       arrival: float | None = None) -> RequestStream:
        """Queues an embedding (the Embed RPC) under the same admission as submit(). Its
        stream ends with one finished output whose `completion.embedding` is the vector;
        it has no text, so the TextStage passes it through untouched."""
        stream = self._new_stream(request_id, len(prompt_ids), arrival)
        self._streams[request_id] = stream
        self._inbox.append(Add(stream, prompt_ids, SamplingParams(max_tokens=1), pooling=pooling))
        self._wake.set()
        return stream

    def _new_stream(self, request_id: str, num_prompt: int, arrival: float | None) -> RequestStream:
        """Admission: a fresh id and a free place among `capacity`, else raises."""
        if request_id in self._streams:
            raise InvalidRequest("request_id", f"{request_id!r} is already in flight")
        if len(self._streams) >= self.capacity:
            raise QueueFull(f"server is full: {len(self._streams)} requests in flight fill the "
                            f"{self.batch_slots} batch slots and {self.max_waiting} waiting places "
                            "(engine.max_num_seqs, engine.max_waiting); retry later")
        return RequestStream(request_id, num_prompt, arrival or time.monotonic())

    def abort(self, request_id: str, notify: bool = False, reason: str = "cancelled") -> bool:
        """Aborts a request. notify=True (Abort RPC, shutdown): its stream gets an "aborted"
        item. notify=False: its handler has stopped listening, for `reason`; the stream gets
        nothing more and ends (metrics included) once the engine has let go of it."""
        stream = self._streams.get(request_id)
        if stream is None or stream.gone:
            return False
        if not notify:
            stream.gone = reason
        self._inbox.append(Abort(stream))
        self._wake.set()
        return True

    def call_on_engine(self, fn: Callable[[], Any]) -> None:
        """Runs fn() on the engine thread before the next step (the stats are published after)."""
        self._inbox.append(Call(fn))
        self._wake.set()

    def abort_all(self) -> int:
        ids = [rid for rid, s in self._streams.items() if not s.gone]
        for rid in ids:
            self.abort(rid, notify=True)
        return len(ids)

    def subscribe_kv(self, start_sequence: int = 0) -> asyncio.Queue:
        return self.kv_events.subscribe(start_sequence)

    def unsubscribe_kv(self, q: asyncio.Queue) -> None:
        self.kv_events.unsubscribe(q)

    def _dispatch(self, items: list, stats: dict | None, kv_events: list | None = None) -> None:
        """Event-loop side of one step: route outputs to their streams, KV events to subscribers."""
        if stats is not None:
            self._stats = stats
        if kv_events:
            self.kv_events.publish(kv_events)
        for kind, stream, payload, t in items:
            if stream.done:
                continue
            finished = True
            if kind == "output":
                payload, stop_at = self._text.render(payload)
                if payload is None:
                    continue  # computed past a stop string: never streamed
                if stop_at is not None:  # the engine finishes it before its next step
                    self._inbox.append(StopAt(stream, stop_at))
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
