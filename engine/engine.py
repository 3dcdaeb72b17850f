"""Engine: add_request / step / generate / stream over scheduler, batch, runner and sampler.

    engine.step():
      scheduler.schedule()             pages, prefix hits, token budget, preemption
      -> batch.build_batch()           numpy, padded to a warm-up-compiled bucket
      -> runner.run()                  device_put -> step.step (jit, cache donated) -> host
      -> _process()                    append tokens, logprobs, detokenize, stops, finish

One thread steps; add_request / abort may come from other threads (one lock guards the
queues; the device call runs outside it). A request whose step fails finishes with
finish_reason "error" and its pages are freed; the engine keeps going.

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

import itertools
import random
import sys
import threading
import time
import traceback
from typing import Iterator

from jaxfill.engine.batch import bucket_shapes, build_batch, describe_buckets, pick_bucket, stack_batches
from jaxfill.engine.config import Config, load_config
from jaxfill.engine.loading import build_mesh, build_model, build_tokenizer, validate_prompt
from jaxfill.engine.request import (Completion, InvalidRequest, QueueFull, Request, RequestOutput,
                            SamplingParams, Status)
from jaxfill.engine.output import append_token
from jaxfill.engine.replicas import ReplicaScheduler
from jaxfill.engine.runner import Runner


class _IdsOnlyTokenizer:
    """Stands in when a checkpoint has no tokenizer.json: token-id prompts only, no text."""

    def __init__(self, reason: str):
        self.reason = reason
        self.vocab_size = None

    def encode(self, text, add_bos=True):
        raise InvalidRequest("prompt", f"text prompts need a tokenizer ({self.reason}); pass token ids")

    def decode(self, ids):
        return ""

    def detokenizer(self, prompt_ids=()):
        return self

    def feed(self, ids):
        return ""

    def flush(self):
        return ""


class Engine:
    def __init__(self, config: Config, progress: bool = True, warmup: bool = True, model=None):
        self.config = config
        s = config.engine
        self.settings = s
        self.vocab_size = config.model.vocab_size
        try:
            self.tokenizer = build_tokenizer(config)
        except ValueError as e:
            self.tokenizer = _IdsOnlyTokenizer(str(e))
        mesh = build_mesh(config)
        if model is None:
            model = build_model(config, mesh, progress=progress)
        self.shapes = bucket_shapes(s)
        self.runner = Runner(config, model, mesh, self.shapes)
        self.scheduler = ReplicaScheduler(s, self.runner.num_replicas)  # one per mesh.data replica
        self.max_pages = s.max_pages_per_seq
        self.requests: dict[str, Request] = {}  # unfinished, by id
        self._lock = threading.RLock()
        self._outbox: list[RequestOutput] = []  # reported by the next step()
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        self._seeds = random.Random(s.seed)
        self.num_steps = 0
        self.num_errors = 0
        self.warmed_up = False
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

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0) -> str:
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
            req.detok = self.tokenizer.detokenizer(ids)
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

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self.requests or self._outbox)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        with self._lock:
            outputs, self._outbox = self._outbox, []
            scheds = self.scheduler.schedule()  # one per data replica
            for req in (r for sched in scheds for r in sched.finished):  # no room in the pool even alone
                outputs.append(self._finish(req, "length"))
            if not any(sched.seqs for sched in scheds):
                return outputs
            shape = pick_bucket(self.shapes, max(sc.num_tokens for sc in scheds), max(len(sc.seqs) for sc in scheds))
            try:
                batch = stack_batches([build_batch(sc, shape, self.settings.page_size, self.max_pages,
                                                   self.vocab_size, self.settings.penalty_window) for sc in scheds])
            except Exception as e:  # noqa: BLE001 - a bad request must not stop the engine
                return outputs + self._fail(scheds, e)
        try:
            host = self.runner.run(batch)
        except Exception as e:  # noqa: BLE001
            with self._lock:
                return outputs + self._fail(scheds, e)
        with self._lock:
            self.num_steps += 1
            now = time.perf_counter()
            for replica, sched in enumerate(scheds):
                for i, sch in enumerate(sched.seqs):
                    out = self._advance(sch, host, replica * shape[1] + i, now)
                    if out is not None:
                        outputs.append(out)
        return outputs

    def _advance(self, sch, host, row: int, now: float) -> RequestOutput | None:
        """A scheduled chunk ran: move the request on, and take its token if it sampled."""
        req = sch.req
        if req.status != Status.RUNNING or self.requests.get(req.request_id) is not req:
            return None  # aborted while the step ran
        try:
            req.num_computed = sch.start + sch.num_new
            self.scheduler.register_computed(req)
            if sch.samples:
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
        if not self.runner.cache_ok():
            # The donated cache is gone: every computed page is lost. Recompute the rest.
            self.runner.reset_cache()
            self.scheduler.recompute_all()
        return outs

    # ------------------------------------------------------------------ per token
    def _append(self, req: Request, token: int, host, row: int, now: float) -> RequestOutput | None:
        emitted, reason, lp = append_token(req, token, host.logprob[row], host.top_ids[row],
                                           host.top_logprobs[row], now, self.settings.max_model_len)
        if reason is not None:
            out = self._finish(req, reason, text=emitted)
            out.new_token_ids = [token]
            out.logprobs = [lp] if lp else None
            return out
        return RequestOutput(req.request_id, [token], emitted, logprobs=[lp] if lp else None)

    def _finish(self, req: Request, reason: str, text: str = "", error: str | None = None) -> RequestOutput:
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
        Outputs of other requests go back to the outbox for whoever steps next."""
        rid = self.add_request(prompt, params, request_id, priority)
        done = False
        try:
            while not done:
                others = []
                for out in self.step():
                    if out.request_id == rid:
                        done = done or out.finished
                        yield out
                    else:
                        others.append(out)
                if others:
                    with self._lock:
                        self._outbox.extend(others)
        finally:
            if not done:
                self.abort(rid)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 priority: int = 0) -> list[Completion]:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise InvalidRequest("params", f"{len(params)} SamplingParams for {len(prompts)} prompts")
            plist = list(params)
        else:
            plist = [params or SamplingParams()] * len(prompts)
        for p in plist:
            p.validate(self.vocab_size)
        rids: list[str | None] = [None] * len(prompts)
        results: dict[str, Completion] = {}
        nxt = 0
        while nxt < len(prompts) or len(results) < len(prompts):
            while nxt < len(prompts):
                try:
                    rids[nxt] = self.add_request(prompts[nxt], plist[nxt], priority=priority)
                except QueueFull:
                    break
                nxt += 1
            others = []
            for out in self.step():
                if out.finished and out.request_id in rids:
                    results[out.request_id] = out.completion
                elif out.request_id not in rids:
                    others.append(out)
            if others:
                with self._lock:
                    self._outbox.extend(others)
        return [results[r] for r in rids]

    def stats(self) -> dict:
        with self._lock:
            return {
                **self.scheduler.stats(),
                "page_size": self.settings.page_size,
                "buckets": len(self.shapes),
                "bucket_shapes": list(self.shapes),
                "num_steps": self.num_steps,
                "num_errors": self.num_errors,
                "compiled_programs": Runner.cache_size(),
            }

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
