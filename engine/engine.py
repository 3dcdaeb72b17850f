"""Engine: add_request / step / generate / stream over scheduler, batch, runner and sampler.

    engine.step():
      scheduler.schedule()             pages, prefix hits, token budget, preemption
      -> batch.build_batch()           numpy, padded to a warm-up-compiled bucket
      -> runner.run()                  device_put -> step.step (jit, cache donated) -> host
      -> _process()                    append tokens, logprobs, detokenize, stops, finish

One thread steps; add_request / abort may come from other threads (one lock guards the
queues; the device call runs outside it). A request whose step fails finishes with
finish_reason "error" and its pages are freed; the engine keeps going.
"""

from __future__ import annotations

import itertools
import random
import sys
import threading
import time
import traceback
from typing import Iterable, Iterator

from engine.batch import bucket_shapes, build_batch, pick_bucket
from engine.config import Config, load_config
from engine.loading import build_mesh, build_model, build_tokenizer, validate_prompt
from engine.request import (Completion, InvalidRequest, QueueFull, Request, RequestOutput,
                            SamplingParams, Status)
from engine.runner import Runner
from engine.scheduler import Scheduler


class _IdsOnlyTokenizer:
    """Stands in when a checkpoint has no tokenizer.json: token-id prompts only, no text."""

    def __init__(self, reason: str):
        self.reason = reason
        self.vocab_size = None

    def encode(self, text, add_bos=True):
        raise InvalidRequest("prompt", f"text prompts need a tokenizer ({self.reason}); pass token ids")

    def decode(self, ids):
        return ""

    def detokenizer(self):
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
        self.runner = Runner(config, model, mesh)
        self.scheduler = Scheduler(s)
        self.shapes = bucket_shapes(s)
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
        if warmup:
            self.warmup(progress)

    @classmethod
    def from_config(cls, config="tiny", model_path=None, overrides=None, progress: bool = True) -> "Engine":
        return cls(load_config(config, overrides, model_path), progress=progress)

    # ------------------------------------------------------------------ warm-up
    def warmup(self, progress: bool = True) -> None:
        """Compiles every (tokens, seqs) bucket before the engine reports ready."""
        if progress:
            shapes = ", ".join(f"{t}x{s}" for t, s in self.shapes)
            print(f"jaxfill: compiling {len(self.shapes)} step buckets (tokens x seqs): {shapes}",
                  file=sys.stderr, flush=True)
        start = time.perf_counter()
        self.runner.warmup(self.shapes, self.max_pages, self.settings.penalty_window, progress)
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
        with self._lock:
            if request_id is None:
                request_id = f"req-{next(self._ids)}"
                while request_id in self.requests:
                    request_id = f"req-{next(self._ids)}"
            elif not isinstance(request_id, str) or not request_id:
                raise InvalidRequest("request_id", "must be a non-empty string")
            if request_id in self.requests:
                raise InvalidRequest("request_id", f"{request_id!r} is already in flight")
            if len(self.scheduler.waiting) >= s.max_waiting:
                raise QueueFull(f"{len(self.scheduler.waiting)} requests waiting (engine.max_waiting)")
            seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
            req = Request(request_id, ids, params, priority, next(self._arrivals), seed,
                          eos_token_ids=self.config.model.eos_token_id or ())
            req.detok = self.tokenizer.detokenizer()
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
            sched = self.scheduler.schedule()
            for req in sched.finished:  # no room in the pool even alone
                outputs.append(self._finish(req, "length"))
            if not sched.seqs:
                return outputs
            shape = pick_bucket(self.shapes, sched.num_tokens, len(sched.seqs))
            try:
                batch = build_batch(sched, shape, self.settings.page_size, self.max_pages,
                                    self.vocab_size, self.settings.penalty_window)
            except Exception as e:  # noqa: BLE001 - a bad request must not stop the engine
                return outputs + self._fail(sched, e)
        try:
            host = self.runner.run(batch)
        except Exception as e:  # noqa: BLE001
            with self._lock:
                return outputs + self._fail(sched, e)
        with self._lock:
            self.num_steps += 1
            now = time.perf_counter()
            for row, sch in enumerate(sched.seqs):
                req = sch.req
                if req.status != Status.RUNNING or self.requests.get(req.request_id) is not req:
                    continue  # aborted while the step ran
                try:
                    req.num_computed = sch.start + sch.num_new
                    self.scheduler.register_computed(req)
                    if sch.samples:
                        out = self._append(req, int(host.tokens[row]), host, row, now)
                        if out is not None:
                            outputs.append(out)
                except Exception as e:  # noqa: BLE001
                    outputs.append(self._finish(req, "error", error=f"{type(e).__name__}: {e}"))
        return outputs

    def _fail(self, sched, exc: Exception) -> list[RequestOutput]:
        """The step raised: its requests finish with "error"; the engine carries on."""
        self.num_errors += 1
        msg = f"{type(exc).__name__}: {exc}"
        traceback.print_exc(file=sys.stderr)
        outs = []
        for sch in sched.seqs:
            if self.requests.get(sch.req.request_id) is sch.req:
                outs.append(self._finish(sch.req, "error", error=msg))
        if not self.runner.cache_ok():
            # The donated cache is gone: every computed page is lost. Recompute the rest.
            self.runner.reset_cache()
            for req in list(self.scheduler.running):
                self.scheduler._preempt(req)
            self.scheduler.bm.reset_prefix_cache()
        return outs

    # ------------------------------------------------------------------ per token
    def _append(self, req: Request, token: int, host, row: int, now: float) -> RequestOutput | None:
        p = req.params
        req.output_ids.append(token)
        if req.first_token is None:
            req.first_token = now
        req.last_token = now
        lp = None
        if req.logprobs is not None:
            n = p.logprobs
            lp = {"token_id": token, "logprob": float(host.logprob[row]),
                  "top": [(int(i), float(v)) for i, v in zip(host.top_ids[row][:n], host.top_logprobs[row][:n])]}
            req.logprobs.append(lp)
        new_text = req.detok.feed([token])
        reason = None
        if token in req.eos_token_ids or token in p.stop_token_ids:
            reason = "stop"
        elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.settings.max_model_len:
            reason = "length"
        if reason is not None:
            new_text += req.detok.flush()
        emitted, hit = self._stop_strings(req, new_text, final=reason is not None)
        if hit:
            reason = "stop"
        if reason is not None:
            out = self._finish(req, reason, text=emitted)
            out.new_token_ids = [token]
            out.logprobs = [lp] if lp else None
            return out
        return RequestOutput(req.request_id, [token], emitted, logprobs=[lp] if lp else None)

    @staticmethod
    def _stop_strings(req: Request, new_text: str, final: bool) -> tuple[str, bool]:
        """Text safe to emit now, and whether a stop string ended the request. Text that
        could be the start of a stop string is held back until it cannot be."""
        stops = req.params.stop
        if not stops:
            req.text += new_text
            return new_text, False
        buf = req.pending_text + new_text
        cut = min((i for i in (buf.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            req.pending_text = ""
            req.text += buf[:cut]
            return buf[:cut], True
        hold = 0
        if not final:
            for s in stops:
                for k in range(min(len(s) - 1, len(buf)), 0, -1):
                    if buf.endswith(s[:k]):
                        hold = max(hold, k)
                        break
        emit = buf[:len(buf) - hold]
        req.pending_text = buf[len(buf) - hold:]
        req.text += emit
        return emit, False

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
            bm = self.scheduler.bm
            return {
                "pages_total": bm.num_usable,
                "pages_free": bm.num_free,
                "pages_cached": len(bm.cached),
                "page_size": self.settings.page_size,
                "num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting),
                "buckets": len(self.shapes),
                "bucket_shapes": list(self.shapes),
                "prefix_cache_hits": bm.hits,
                "prefix_cache_queries": bm.queries,
                "cached_tokens_total": self.scheduler.cached_tokens_total,
                "num_preemptions": self.scheduler.num_preemptions,
                "num_steps": self.num_steps,
                "num_errors": self.num_errors,
                "compiled_programs": Runner.cache_size(),
            }
