"""Engine: add_request / step / generate / stream over scheduler, batch, runner and sampler.

    engine.step():
      scheduler.schedule()             pages, prefix hits, token budget, preemption
      -> batch.build_batch()           numpy, padded to a warm-up-compiled bucket
      -> runner.run()                  device_put -> step.step (jit, cache donated), returns at once
      -> _advance()                    .get() the tokens: append, logprobs, detokenize, stops, finish

engine.async_scheduling (the default) reorders it: plan and dispatch step N+1, then take
step N's tokens while N+1 runs; decodes whose input is still on the device read it there
(engine/async_step.py). defer_text = True (a serving loop) leaves detokenization, stop
strings and logprob formatting to the caller (serving/text_stage.py, Engine.stop_at).

One thread steps: a step() (or generate / stream) while another thread is inside step()
raises RuntimeError at once, since two steppers would compute one chunk twice and race on
the donated KV cache. add_request / abort / abort_all may come from any thread (one lock
guards the queues; the device call runs outside it). A request whose step fails finishes
with finish_reason "error" and its pages are freed; the engine keeps going.

Interrupts (KeyboardInterrupt in a notebook) propagate but leave the engine consistent:
outputs step() took or produced go back to the outbox, generate / stream abort their own
requests, and a KV cache lost between donation and store is rebuilt before the next step.

mesh.data = R > 1: R schedulers and page pools (engine/replicas.py); each step stacks
their batches, padded to one bucket, into one data-parallel step.

Multi-process (jax.distributed): every process builds the Engine; process 0 owns the
scheduler and drives it, the others call `follow()` and run each step process 0
broadcasts; `close()` on process 0 releases them:

    with Engine.from_config(cfg) as engine:
        if engine.is_leader:
            completions = engine.generate(prompts)
        else:
            engine.follow()
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import random
import sys
import threading
import time
import traceback
from typing import Iterator

from jaxfill.engine.batch import bucket_shapes, build_batch, describe_buckets, pick_bucket, stack_batches
from jaxfill.engine.config import Config, load_config
from jaxfill.engine.cpu_devices import use_cpu_cores
from jaxfill.engine.loading import build_mesh, build_model, build_tokenizer, validate_prompt
from jaxfill.engine.mesh import with_mesh_shape
from jaxfill.engine.request import (Completion, InvalidRequest, QueueFull, Request, RequestOutput,
                            SamplingParams, Status)
from jaxfill.engine.async_step import Launch, mark_in_flight, rewind
from jaxfill.engine.output import append_token, record_token
from jaxfill.engine.replicas import ReplicaScheduler
from jaxfill.engine.runner import Runner
from jaxfill.engine.stepping import StepGuard
from jaxfill.engine.tokenizer import IdsOnlyTokenizer
from jaxfill.models.quant import param_bytes


class Engine:
    def __init__(self, config: Config, progress: bool = True, warmup: bool = True, model=None):
        use_cpu_cores(config.mesh)  # first: one XLA CPU device per core, before jax starts
        self.config = config
        s = config.engine
        self.settings = s
        self.vocab_size = config.model.vocab_size
        try:
            self.tokenizer = build_tokenizer(config)
        except ValueError as e:
            self.tokenizer = IdsOnlyTokenizer(str(e))
        mesh = build_mesh(config)
        self.config = config = with_mesh_shape(config, mesh)  # a CPU split's mesh.tensor
        if model is None:
            model = build_model(config, mesh, progress=progress)
        self.shapes = bucket_shapes(s)
        self.runner = Runner(config, model, mesh, self.shapes)
        self.config = config = self.runner.config  # engine.num_pages = 0 is resolved there
        self.settings = s = config.engine
        self.scheduler = ReplicaScheduler(s, self.runner.num_replicas)  # one per mesh.data replica
        self.max_pages = s.max_pages_per_seq
        self.requests: dict[str, Request] = {}  # unfinished, by id
        self._lock = threading.RLock()
        self._outbox: list[RequestOutput] = []  # reported by the next step()
        self._guard = StepGuard(self._lock)  # one thread steps (engine/stepping.py)
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        self._seeds = random.Random(s.seed)
        self.num_steps = 0
        # True: step() leaves text and logprob formatting to the caller (a serving loop does
        # them off this thread, serving/text_stage.py); outputs carry ids and raw_logprobs.
        self.defer_text = False
        self._in_flight: Launch | None = None  # async scheduling: the step whose tokens are not yet taken
        self.num_errors = 0
        self.num_cache_resets = 0
        self.warmed_up = False
        self.kv_handoff = None  # disaggregated prefill (engine/kv_handoff.py): enable_kv_transfer()
        if warmup and self.is_leader:  # followers compile as they follow the leader's warm-up
            self.warmup(progress)

    @classmethod
    def from_config(cls, config="tiny", model_path=None, overrides=None, progress: bool = True) -> "Engine":
        return cls(load_config(config, overrides, model_path), progress=progress)

    # ------------------------------------------------------------------ warm-up
    def warmup(self, progress: bool = True) -> None:
        """Compiles every (tokens, seqs) bucket before the engine reports ready."""
        self._leader_only("warmup")
        if progress:
            print(f"jaxfill: compiling {describe_buckets(self.shapes)}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        with self._guard.claim():
            self.runner.warmup(progress)
        self.warmup_s = time.perf_counter() - start
        self.warmed_up = True

    # ------------------------------------------------------------------ requests
    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        try:
            return [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise InvalidRequest("prompt", "must be a string or a list of token ids") from None

    def _check_request(self, prompt, params: SamplingParams | None,
                       priority: int) -> tuple[list[int], SamplingParams]:
        """Everything about one request that can be checked without the queues: (ids, params)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequest("params", f"must be SamplingParams, got {type(params).__name__}")
        params.validate(self.vocab_size)
        ids = self._encode(prompt)
        s = self.settings
        validate_prompt(ids, self.vocab_size, s.max_model_len)
        need = -(-(len(ids) + 1) // s.page_size)
        if need > s.num_pages - 1:
            raise InvalidRequest("prompt", f"needs {need} KV pages; the pool has {s.num_pages - 1} "
                                 f"(engine.num_pages x engine.page_size)")
        if not isinstance(priority, int):
            raise InvalidRequest("priority", f"must be an integer, got {priority!r}")
        return ids, params

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0) -> str:
        ids, params = self._check_request(prompt, params, priority)
        s = self.settings
        self._leader_only("add_request")
        with self._lock:
            if request_id is None:
                request_id = f"req-{next(self._ids)}"
                while request_id in self.requests:
                    request_id = f"req-{next(self._ids)}"
            elif not isinstance(request_id, str) or not request_id:
                raise InvalidRequest("request_id", "must be a non-empty string")
            if request_id in self.requests:
                raise InvalidRequest("request_id", f"{request_id!r} is already in flight")
            waiting = self.scheduler.num_waiting()
            if waiting >= s.max_waiting:
                raise QueueFull(f"{waiting} requests waiting (engine.max_waiting)")
            seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
            req = Request(request_id, ids, params, priority, next(self._arrivals), seed,
                          eos_token_ids=self.config.model.eos_token_id or ())
            req.detok = None if self.defer_text else self.tokenizer.detokenizer(ids)
            self.requests[request_id] = req
            self.scheduler.add(req)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Frees the request's pages now; it finishes with "abort" at the next step()."""
        with self._lock:
            req = self.requests.get(request_id)
            if req is None:
                return False
            self._outbox.append(self._finish(req, "abort"))
            return True

    def abort_all(self) -> int:
        """Aborts every unfinished request and drops every output not yet returned (after an
        interrupted notebook cell, say); returns how many requests were aborted."""
        with self._lock:
            n = len(self.requests)
            self._discard(list(self.requests))
            self._outbox.clear()
            return n

    def _discard(self, request_ids) -> None:
        """Aborts these requests and drops their pending outputs: whoever wanted them is gone
        (a generate() or stream() that raised or was closed)."""
        ids = set(request_ids)
        with self._lock:
            for rid in ids:
                req = self.requests.get(rid)
                if req is not None:
                    self._finish(req, "abort")
            self._outbox = [o for o in self._outbox if o.request_id not in ids]

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self.requests or self._outbox)

    # ------------------------------------------------------------------ step
    @contextlib.contextmanager
    def own_stepping(self):
        """While inside, only the calling thread may step (a serving loop): another thread's
        step()/generate()/stream() is refused even between two of the owner's steps."""
        with self._guard.own():
            yield self

    def step(self) -> list[RequestOutput]:
        with self._guard.claim():
            return self._step()

    def _recover_cache(self) -> None:
        """A step that died between donating the KV cache and storing its successor (an
        error, or an interrupt) leaves deleted buffers: start from a fresh cache and send
        the running requests back to be recomputed, so no later request fails for it."""
        if not self.runner.cache_ok():
            self.runner.reset_cache()
            self.scheduler.recompute_all()
            self.num_cache_resets += 1

    def _step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        try:
            return self._step_into(outputs)
        except BaseException:
            with self._lock:  # nothing taken from or produced for the outbox is lost
                self._outbox[:0] = outputs
            raise

    def _plan(self, outputs: list[RequestOutput]) -> Launch | None:
        """[lock] Schedules and builds the next step; None when nothing is to run."""
        outputs += self._outbox
        self._outbox = []
        if self.kv_handoff is not None:
            self.kv_handoff.expire()
        self._recover_cache()
        scheds = self.scheduler.schedule()  # one per data replica
        for req in (r for sched in scheds for r in sched.finished):  # no room in the pool even alone
            outputs.append(self._finish(req, "length"))
        if not any(sched.seqs for sched in scheds):
            return None
        shape = pick_bucket(self.shapes, max(sc.num_tokens for sc in scheds), max(len(sc.seqs) for sc in scheds))
        try:
            batch = stack_batches([build_batch(sc, shape, self.settings.page_size, self.max_pages,
                                               self.vocab_size, self.settings.penalty_window) for sc in scheds])
        except Exception as e:  # noqa: BLE001 - a bad request must not stop the engine
            outputs += self._fail(scheds, e)
            return None
        return Launch(scheds, shape, batch)

    def _step_into(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Dispatches step N+1, then takes step N's tokens while N+1 runs, so the host work
        of one step hides behind the device work of the next (engine/async_step.py). With
        async_scheduling off, the step just dispatched is taken at once: the same code,
        one step at a time."""
        done = set()  # ids of taken rows
        prev = launch = None
        try:
            with self._lock:
                launch = self._plan(outputs)
            if launch is not None:
                try:
                    launch.pending = self.runner.run(launch.batch)
                except Exception as e:  # noqa: BLE001
                    with self._lock:
                        outputs += self._fail(launch.scheds, e)
                    launch = None
                else:
                    with self._lock:
                        mark_in_flight(launch)
            if self.settings.async_scheduling:
                prev, self._in_flight = self._in_flight, launch
            else:
                prev, launch = launch, None
            if prev is not None:
                self._take(prev, outputs, done)
        except BaseException:
            with self._lock:  # an interrupt: what was in flight is recomputed, never half-known
                rewind([x for x in (self._in_flight, prev, launch) if x is not None], done)
                self._in_flight = None
            raise
        return outputs

    def _take(self, launch: Launch, outputs: list[RequestOutput], done: set) -> None:
        """Step N's results reach the host: tokens, prefix-cache pages, stops."""
        try:
            host = launch.pending.get()
        except Exception as e:  # noqa: BLE001
            with self._lock:
                outputs += self._fail(launch.scheds, e)
                return
        with self._lock:
            self.num_steps += 1
            now = time.perf_counter()
            for sch, row in launch.rows():
                out = self._advance(sch, host, row, now)
                done.add(id(sch))
                if out is not None:
                    outputs.append(out)

    def _advance(self, sch, host, row: int, now: float) -> RequestOutput | None:
        """One row of step N, whose request may have been scheduled again since (N+1 is in
        flight), preempted (its token still counts) or finished (nothing happens)."""
        req = sch.req
        if req.finished or self.requests.get(req.request_id) is not req:
            return None  # aborted or stopped; an extra token computed for it is dropped here
        try:
            if req.status == Status.RUNNING:  # (re-admitted since: not beyond what it has computed)
                self.scheduler.register_computed(req, min(sch.start + sch.num_new, req.num_computed), sch.start)
            if sch.samples:
                req.in_flight -= 1
                return self._append(req, int(host.tokens[row]), host, row, now)
        except Exception as e:  # noqa: BLE001
            return self._finish(req, "error", error=f"{type(e).__name__}: {e}")
        return None

    def _fail(self, scheds, exc: Exception) -> list[RequestOutput]:
        """The step raised: its requests finish with "error"; the engine carries on."""
        self.num_errors += 1
        msg = f"{type(exc).__name__}: {exc}"
        traceback.print_exc(file=sys.stderr)
        outs = []
        for sch in (sch for sched in scheds for sch in sched.seqs):
            if self.requests.get(sch.req.request_id) is sch.req:
                outs.append(self._finish(sch.req, "error", error=msg))
        self._recover_cache()
        return outs

    # ------------------------------------------------------------------ per token
    def _append(self, req: Request, token: int, host, row: int, now: float) -> RequestOutput | None:
        if self.defer_text:
            return self._append_ids(req, token, host, row, now)
        emitted, reason, lp = append_token(req, token, host.logprob[row], host.top_ids[row],
                                           host.top_logprobs[row], now, self.settings.max_model_len)
        if reason is not None:
            out = self._finish(req, reason, text=emitted)
            out.new_token_ids = [token]
            out.logprobs = [lp] if lp else None
            return out
        return RequestOutput(req.request_id, [token], emitted, logprobs=[lp] if lp else None)

    def _append_ids(self, req: Request, token: int, host, row: int, now: float) -> RequestOutput:
        """defer_text: ids, timings and the stops scheduling needs; text and logprob
        formatting are the caller's (serving/text_stage.py)."""
        reason = record_token(req, token, now, self.settings.max_model_len)
        raw = None
        if req.logprobs is not None:
            n = req.params.logprobs
            raw = [(float(host.logprob[row]), host.top_ids[row][:n].tolist(), host.top_logprobs[row][:n].tolist())]
        out = RequestOutput(req.request_id, [], "") if reason is None else self._finish(req, reason)
        out.new_token_ids = [token]
        out.raw_logprobs = raw
        return out

    def stop_at(self, request_id: str, num_tokens: int) -> bool:
        """defer_text: a stop string ended the request at its first num_tokens tokens (the
        caller found it in the text); it finishes with "stop" now, pages freed, and its final
        output comes with the next step()."""
        with self._lock:
            req = self.requests.get(request_id)
            if req is None:
                return False
            del req.output_ids[num_tokens:]
            self._outbox.append(self._finish(req, "stop"))
            return True

    def _finish(self, req: Request, reason: str, text: str = "", error: str | None = None) -> RequestOutput:
        if self.kv_handoff is not None:  # a held prefill keeps its pages for the decode side's pull
            self.kv_handoff.take_on_finish(req, reason)
        self.scheduler.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.error = error
        req.finished_at = time.perf_counter()
        self.requests.pop(req.request_id, None)
        return RequestOutput(req.request_id, [], text, finished=True, completion=req.completion())

    # ------------------------------------------------------------------ conveniences
    def stream(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
               priority: int = 0) -> Iterator[RequestOutput]:
        """Adds one request and steps the engine until it finishes, yielding its chunks.
        Outputs of other requests go back to the outbox for whoever steps next. If the
        stream is closed early or raises, its request is aborted and its outputs dropped."""
        self._guard.refuse_others()
        rid = self.add_request(prompt, params, request_id, priority)
        done = False
        try:
            while not done:
                outs = self.step()
                others = [o for o in outs if o.request_id != rid]
                if others:
                    with self._lock:
                        self._outbox.extend(others)
                for out in (o for o in outs if o.request_id == rid):
                    done = done or out.finished
                    yield out
        finally:
            if not done:
                self._discard([rid])

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 priority: int = 0) -> list[Completion]:
        """Runs the prompts to completion. Every prompt is checked before any is added; on
        any exception (KeyboardInterrupt included) its requests are aborted and their
        outputs dropped, then the exception propagates."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise InvalidRequest("params", f"{len(params)} SamplingParams for {len(prompts)} prompts")
            plist = list(params)
        else:
            plist = [params or SamplingParams()] * len(prompts)
        checked = []
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            try:
                checked.append(self._check_request(prompt, p, priority))
            except InvalidRequest as e:
                raise InvalidRequest(e.field, f"prompt {i}: {str(e).removeprefix(e.field + ': ')}") from None
        self._guard.refuse_others()
        rids: list[str] = []
        results: dict[str, Completion] = {}
        try:
            while len(rids) < len(checked) or len(results) < len(checked):
                while len(rids) < len(checked):
                    ids, p = checked[len(rids)]
                    try:
                        rids.append(self.add_request(ids, p, priority=priority))
                    except QueueFull:
                        break
                mine = set(rids)
                others = []
                for out in self.step():
                    if out.request_id not in mine:
                        others.append(out)
                    elif out.finished:
                        results[out.request_id] = out.completion
                if others:
                    with self._lock:
                        self._outbox.extend(others)
            return [results[r] for r in rids]
        except BaseException:
            self._discard(rids)
            raise

    def stats(self) -> dict:
        with self._lock:
            return {
                **self.scheduler.stats(),
                "page_size": self.settings.page_size,
                "buckets": len(self.shapes),
                "bucket_shapes": list(self.shapes),
                "num_steps": self.num_steps,
                "num_errors": self.num_errors,
                "num_cache_resets": self.num_cache_resets,
                "attention_impl": self.runner.attention_impl,  # what serves, after the warm-up check
                "weight_bytes": param_bytes(self.runner.state),  # all params, global shapes
                "kv_cache_dtype": self.settings.kv_cache_dtype,
                "kv_cache_bytes": self.runner.kv_cache.nbytes(),  # values + scales, all shards
                "kv_bytes_per_token": self.runner.kv_cache.bytes_per_token(),
                "compiled_programs": Runner.cache_size(),
            }

    def set_kv_event_listener(self, listener) -> None:
        """listener(replica, *event) hears every data replica's prefix-cache events
        (engine/block_manager.py) on the stepping thread; None removes it."""
        with self._lock:
            for i, sch in enumerate(self.scheduler.replicas):
                sch.bm.listener = None if listener is None else functools.partial(listener, i)

    # ------------------------------------------------------------------ disaggregation
    def enable_kv_transfer(self, host: str = "127.0.0.1"):
        """Starts this engine's transfer server (engine/kv_handoff.py); idempotent."""
        from jaxfill.engine.kv_handoff import KVHandoff

        with self._lock:
            if self.kv_handoff is None:
                self.kv_handoff = KVHandoff(self, host)
            return self.kv_handoff

    def hold_pages(self, request_id: str) -> None:
        """Prefill side: when this request finishes, its prompt's pages are kept and offered;
        `take_kv_offer` then gives what the decode side needs."""
        with self._lock:
            self.enable_kv_transfer().hold.add(request_id)

    def take_kv_offer(self, request_id: str) -> dict | None:
        with self._lock:
            return None if self.kv_handoff is None else self.kv_handoff.offers.pop(request_id, None)

    def release_held(self, transfer_id: int) -> bool:
        """Prefill side: the decode side has pulled (or given up): free the held pages."""
        with self._lock:
            return self.kv_handoff is not None and self.kv_handoff.release(int(transfer_id))

    def expire_held(self) -> int:
        """Frees held pages older than engine.kv_transfer_timeout_s; returns how many offers."""
        with self._lock:
            return 0 if self.kv_handoff is None else self.kv_handoff.expire()

    def add_prefilled_request(self, prompt, params: SamplingParams | None, request_id: str, arrays: list,
                              num_tokens: int, cached_tokens: int = 0, priority: int = 0) -> str:
        """Decode side, stepping thread: admits a request whose first num_tokens prompt rows
        were pulled into `arrays` (KVHandoff.pull); it continues from its last prompt token."""
        self._leader_only("add_prefilled_request")
        return self.enable_kv_transfer().admit(self._encode(prompt), params, request_id, arrays, num_tokens,
                                               cached_tokens, priority)

    # ------------------------------------------------------------------ multi-process
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

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
