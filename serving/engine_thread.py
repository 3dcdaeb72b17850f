"""The engine thread of an EngineLoop: drains the inbox, steps, posts outputs.

Inbox messages are typed (below) and applied in order before every step, so an abort
queued behind its own add still finds the request. Adds the engine refuses for a full
queue stay, in order, in the backlog and go in as steps make room. A step that raises
fails every request in flight; the thread keeps serving.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
import traceback
from typing import Any, Callable

from jaxfill.engine.request import InvalidRequest, PoolingParams, QueueFull, RequestOutput, SamplingParams
from jaxfill.engine.sleep import EngineAsleep

log = logging.getLogger("jaxfill.serving")

WARMING, SERVING, DRAINING, STOPPED, FAILED = "warming", "serving", "draining", "stopped", "failed"


class StepFailed(RuntimeError):
    """engine.step() raised; every request in flight at that moment fails with it."""


@dataclasses.dataclass
class Add:
    stream: Any  # RequestStream
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0
    after: str | None = None  # a sibling sample's request id (Engine.add_request's `after`)
    pooling: PoolingParams | None = None  # set: an embedding (Engine.add_pooling_request), params unused
    replica: int | None = None  # the data replica it is pinned to (vLLM's data_parallel_rank), else placed


@dataclasses.dataclass
class Abort:
    stream: Any  # RequestStream


@dataclasses.dataclass
class StopAt:
    """A stop string ended the request after num_tokens tokens (found by the TextStage)."""

    stream: Any  # RequestStream
    num_tokens: int


@dataclasses.dataclass
class Call:
    """call_on_engine: fn() on the engine thread (serving/disagg.py: release or expire held KV)."""

    fn: Callable[[], Any]


class EngineThread:
    """Mixin of EngineLoop (serving/engine_loop.py): the half that runs on its thread.
    Reads and writes only `_inbox`, `_backlog`, `_in_engine` and the engine."""

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

    def _post(self, items: list, stats: dict | None = None) -> None:
        kv_events = self.kv_events.take()
        if items or stats is not None or kv_events:
            try:
                self._loop.call_soon_threadsafe(self._dispatch, items, stats, kv_events)
            except RuntimeError:  # event loop closed: shutting down
                pass

    def _drain_inbox(self) -> list:
        """Applies the queued messages in order, then hands the engine what it takes."""
        items = []
        while self._inbox:
            msg = self._inbox.popleft()
            if isinstance(msg, Add):
                self._backlog.append(msg)
            elif isinstance(msg, Call):
                self._quietly(msg.fn)
            elif isinstance(msg, StopAt):
                if self._in_engine.get(msg.stream.request_id) is msg.stream:
                    self.engine.stop_at(msg.stream.request_id, msg.num_tokens)
            elif isinstance(msg, Abort):
                items.append(self._abort_now(msg.stream))
            else:
                raise TypeError(f"unknown inbox message {msg!r}")
        while self._backlog:
            if not self._admit(self._backlog[0], items):
                break  # the engine is full: the rest (hooks kept) goes in as steps empty it
            self._backlog.popleft()
        return items

    def _abort_now(self, stream) -> tuple:
        rid = stream.request_id
        if self._in_engine.get(rid) is stream:
            del self._in_engine[rid]
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001
                log.error("abort(%s) failed:\n%s", rid, traceback.format_exc())
        else:
            self._backlog = collections.deque(a for a in self._backlog if a.stream is not stream)
        return ("aborted", stream, None, time.monotonic())  # ignored if it ended first

    def _admit(self, add: Add, items: list) -> bool:
        """One backlogged add into the engine; False when the engine is full (kept)."""
        stream = add.stream
        try:
            admit = self.admit_hooks.get(stream.request_id)  # serving/disagg.py
            if admit is not None:
                admit(self.engine, add.prompt_ids, add.params, stream.request_id, add.priority, add.replica)
            elif add.pooling is not None:
                self.engine.add_pooling_request(add.prompt_ids, add.pooling, request_id=stream.request_id)
            else:
                self.engine.add_request(add.prompt_ids, add.params, request_id=stream.request_id,
                                        priority=add.priority, after=add.after, replica=add.replica)
            self._in_engine[stream.request_id] = stream
        except QueueFull:
            return False
        except (InvalidRequest, EngineAsleep) as e:
            items.append(("error", stream, e, time.monotonic()))
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the loop
            log.error("add_request(%s) failed:\n%s", stream.request_id, traceback.format_exc())
            items.append(("error", stream, StepFailed(f"add_request failed: {e}"), time.monotonic()))
        self.admit_hooks.pop(stream.request_id, None)
        return True

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
