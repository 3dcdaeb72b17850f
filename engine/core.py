"""EngineCore: requests in, one step at a time, outputs out.

    EngineCore.step():
      scheduler.schedule()              pages, prefix hits, token budget, preemption
      -> batch.build_batch()            numpy, padded to a warm-up-compiled bucket
      -> runner.run()                   device_put -> step.step (jit, cache donated), returns at once
      -> scheduler.on_dispatch()        the requests advance as if the step had finished
      -> scheduler.update_from_output() per row, once the tokens reach the host: ids, stops
      -> output.emit_text()             text, stop strings, logprobs (unless defer_text)

The scheduler (engine/scheduler/) is the one owner of request state: this file decides
*when* a transition happens, never how. engine.async_scheduling (the default) takes step
N's tokens after dispatching N+1, so host work hides behind device work (engine/
async_step.py). defer_text=True (a serving loop) leaves detokenization, stop strings
and logprob formatting to the caller (serving/text_stage.py, stop_at).

One thread steps (engine/stepping.py); add_request / abort may come from any thread (one
lock guards the queues; the device call runs outside it). A request whose step fails
finishes with "error", pages freed, and the engine goes on; an interrupt (KeyboardInterrupt
in a notebook) leaves it consistent: outputs go back to the outbox, lost steps are
rewound, a KV cache lost between donation and store is rebuilt. mesh.data = R > 1: R
schedulers and page pools whose batches are stacked into one step.

The phases of a step, and what each does when it fails, are engine/step_phases.py; this
class decides their order and what an interrupt rewinds. The lock and the outbox are its
own: Engine (engine/engine.py) builds generate, stream and stats on the public methods
below (discard, return_outputs, locked, claim_stepping), so the queues and the outbox
change only here and in the phases.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Iterable

from jaxfill.engine.assembly import Parts
from jaxfill.engine.async_step import Launch
from jaxfill.engine.batch import describe_buckets
from jaxfill.engine.compile_cache import warmup_summary
from jaxfill.engine.disagg.facade import Disaggregation
from jaxfill.engine.request import InvalidRequest, QueueFull, Request, RequestOutput, SamplingParams
from jaxfill.engine.step_phases import StepPhases
from jaxfill.engine.stepping import StepGuard
from jaxfill.engine.vision.prompt import image_keys


class EngineCore:
    """The step core. Its lock and outbox stay private, so whatever Engine (or anyone else)
    builds on top cannot leave the queues half-changed; Engine documents the methods it
    exposes under the same names (add_request, abort, stop_at, step, warmup, own_stepping)."""

    def __init__(self, parts: Parts, defer_text: bool = False):
        self.config = parts.config
        self.settings = parts.config.engine
        self.runner, self.scheduler, self.factory = parts.runner, parts.scheduler, parts.factory
        self.shapes = parts.shapes
        self.lora = parts.lora  # LoRA adapters and slots (engine/lora/slots.py), None when off
        self.vocab_size = self.config.model.vocab_size
        self.max_pages = self.settings.max_pages_per_seq
        # True: step() leaves text and logprob formatting to the caller (a serving loop does
        # them off this thread, serving/text_stage.py); outputs carry ids and raw_logprobs.
        self.defer_text = bool(defer_text)
        self._lock = threading.RLock()
        self._outbox: list[RequestOutput] = []  # reported by the next step()
        self._guard = StepGuard(self._lock)  # one thread steps (engine/stepping.py)
        self._in_flight: Launch | None = None  # async scheduling: the step whose tokens are not yet taken
        # Speculative decoding proposes from the newest token and verifies on the host before the
        # next step is scheduled: a step with proposals is taken at once. With async scheduling
        # on, steps without them still overlap, and the step in flight is taken first only when
        # the policy would let some decode propose (engine/speculative/policy.py).
        self.spec_async = self.settings.async_scheduling and self.config.speculative.enabled
        self.async_scheduling = self.settings.async_scheduling and not self.config.speculative.enabled
        self.warmed_up = False
        self.warmup_s: float | None = None
        self.warmup_programs: tuple | None = None  # (loaded from the cache, compiled)
        # disaggregated prefill (engine/disagg/): the hand-off starts with enable_kv_transfer()
        self.disagg = Disaggregation(self._lock, self.config, self.runner, self.scheduler, self.factory)
        self._phases = StepPhases(self._lock, self.runner, self.scheduler, self.disagg, self.settings, self.shapes,
                                  self.vocab_size)

    @property
    def num_steps(self) -> int:
        return self._phases.num_steps

    @property
    def num_errors(self) -> int:
        return self._phases.num_errors

    @property
    def num_cache_resets(self) -> int:
        return self._phases.num_cache_resets

    @property
    def tokenizer(self):
        return self.factory.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        self.factory.tokenizer = tokenizer

    @property
    def requests(self) -> dict[str, Request]:
        """Unfinished requests by id (the scheduler's registry): read it, never write it."""
        return self.scheduler.requests

    @property
    def is_leader(self) -> bool:
        """Process 0 of a multi-process run (or the only process): owns the scheduler."""
        return self.runner.is_leader

    def require_leader(self, what: str) -> None:
        if not self.is_leader:
            raise RuntimeError(f"{what}() runs on process 0 only: process 0 owns the scheduler; "
                               "other processes call engine.follow()")

    def warmup(self, progress: bool = True, buckets: bool = True) -> None:
        self.require_leader("warmup")
        if progress and buckets:
            print(f"jaxfill: preparing {describe_buckets(self.shapes)}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        with self._guard.claim():
            if buckets:
                self.warmup_programs = self.runner.warmup(progress)
            else:
                self.runner.check_attention_impl()
                self.runner.announce_new_shapes = progress
        self.warmup_s = time.perf_counter() - start
        self.warmed_up = True
        if progress and buckets:
            print(f"jaxfill: {warmup_summary(*self.warmup_programs, self.warmup_s)}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ requests (any thread)
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, after: str | None = None, replica: int | None = None) -> str:
        ids, params = self.factory.check(prompt, params, priority)
        self.scheduler.check_replica(replica)
        self.require_leader("add_request")
        with self._lock:
            waiting = self.scheduler.num_waiting()
            if waiting >= self.settings.max_waiting:
                raise QueueFull(f"{waiting} requests waiting (engine.max_waiting)")
            lora_slot, lora_key = self._lora_slot(params)
            if params.n == 1:
                req = self.factory.new(ids, params, request_id, priority, with_text=not self.defer_text)
                req.lora_slot, req.lora_key = lora_slot, lora_key
                sibling = self.requests.get(after) if after is not None else None
                if sibling is not None and self.settings.enable_prefix_caching and sibling.prompt_ids == ids \
                        and image_keys(sibling.images) == image_keys(req.images):  # same images too
                    req.prefill_after = sibling
                self.scheduler.add(req, replica)
                return req.request_id
            samples = self.factory.new_samples(ids, params, request_id, priority, not self.defer_text,
                                               share_prefill=self.settings.enable_prefix_caching)
            for req in samples:
                req.lora_slot, req.lora_key = lora_slot, lora_key
                self.scheduler.add(req, replica)
            return samples[0].parent_id

    def _lora_slot(self, params: SamplingParams) -> tuple[int, str | None]:
        """[lock] The device slot and prefix-hash key of the request's adapter (written into a
        slot now if it is not on the device: engine/lora/slots.py); (0, None) for the base."""
        if params.lora is None:
            return 0, None
        if self.lora is None:
            raise InvalidRequest("lora", "this engine serves no LoRA adapters (lora.max_loras = 0)")
        return self.lora.acquire(params.lora, {r.lora_slot for r in self.requests.values()})

    def lora_call(self, what: str, *args):
        """[lock] load / unload / list on the adapters (engine/lora/slots.py), between steps'
        bookkeeping; unload is told which slots unfinished requests hold."""
        if self.lora is None:
            raise InvalidRequest("lora", "this engine serves no LoRA adapters (set lora.max_loras > 0)")
        with self._lock:
            if what == "unload":
                return self.lora.unload(*args, {r.lora_slot for r in self.requests.values()})
            return getattr(self.lora, what)(*args)

    def add_pooling_request(self, ids: list[int], pooling, request_id: str | None = None) -> str:
        """Queues a pooling request (ids and PoolingParams from factory.check_pooling): it is
        prefilled, never decoded, and finishes with its vector (engine/pooling/)."""
        self.require_leader("add_pooling_request")
        with self._lock:
            waiting = self.scheduler.num_waiting()
            if waiting >= self.settings.max_waiting:
                raise QueueFull(f"{waiting} requests waiting (engine.max_waiting)")
            req = self.factory.new(ids, SamplingParams(max_tokens=1, ignore_eos=True), request_id, with_text=False)
            req.pooling = pooling
            self.scheduler.add(req)
            return req.request_id

    def abort(self, request_id: str) -> bool:
        with self._lock:
            reqs = self._requests_of(request_id)
            for req in reqs:
                self._outbox.append(self._phases.finish(req, "abort"))
            return bool(reqs)

    def stop_at(self, request_id: str, num_tokens: int) -> bool:
        with self._lock:
            req = self.requests.get(request_id)
            if req is None:
                return False
            self._outbox.append(self._phases.finish(req, "stop", num_output_tokens=num_tokens))
            return True

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self.requests or self._outbox)

    def discard(self, request_ids: Iterable[str] | None = None) -> int:
        """Aborts these requests (an id from add_request with n > 1: all its samples) and
        drops their outputs not yet reported, since whoever wanted them is gone (a generate()
        or stream() that raised or was closed). None: every request and every pending
        output. Returns how many requests it aborted."""
        with self._lock:
            everything = request_ids is None
            ids = set(self.requests) if everything else set(request_ids)
            aborted = 0
            for rid in ids:
                for req in self._requests_of(rid):
                    self._phases.finish(req, "abort")
                    aborted += 1
            if everything:
                self._outbox.clear()
            else:
                self._outbox = [o for o in self._outbox if o.request_id not in ids and o.parent_id not in ids]
            return aborted

    def return_outputs(self, outputs: list[RequestOutput]) -> None:
        """Outputs a caller took from step() but does not want (another request's) go back
        to be reported by the next step(), to whoever steps then."""
        if outputs:
            with self._lock:
                self._outbox.extend(outputs)

    @contextlib.contextmanager
    def locked(self):
        """Several reads that must see one state between two changes (stats(), say): no
        request is added, finished or updated while inside."""
        with self._lock:
            yield

    def claim_stepping(self):
        """While inside, this thread is the one stepping (it may read the KV cache); another
        thread's step() is refused, and this one is refused if another thread steps."""
        return self._guard.claim()

    def refuse_other_steppers(self) -> None:
        """Raises now if another thread steps: generate / stream call it before adding anything."""
        self._guard.refuse_others()

    def _requests_of(self, request_id: str) -> list[Request]:
        """[lock] The unfinished request of that id, or the samples it names."""
        req = self.requests.get(request_id)
        if req is not None:
            return [req]
        return [r for r in self.requests.values() if r.parent_id == request_id]

    # ------------------------------------------------------------------ step (one thread)
    @contextlib.contextmanager
    def own_stepping(self, defer_text: bool | None = None):
        with self._guard.own():
            saved = self.defer_text
            if defer_text is not None:
                self.defer_text = bool(defer_text)
            try:
                yield self
            finally:
                self.defer_text = saved

    def step(self) -> list[RequestOutput]:
        """schedule -> restore -> build -> run -> update (engine/step_phases.py). With async
        scheduling step N+1 is dispatched before step N's tokens are taken; without, the
        step just dispatched is taken at once: the same code, one step at a time. With
        speculative decoding (spec_async) a step verifying proposals is taken at once, and
        the step in flight is taken before planning when some decode may propose."""
        outputs: list[RequestOutput] = []
        phases = self._phases
        with self._guard.claim():
            done: set[int] = set()  # id() of the Scheduled rows taken
            prev = launch = drained = None
            try:
                with self._lock:
                    outputs += self._outbox  # first: they were made before this step
                    self._outbox = []
                    drain = self._in_flight is not None and self.spec_async and self.scheduler.wants_proposals()
                if drain:
                    drained, self._in_flight = self._in_flight, None  # its tokens first: proposals need them
                    phases.update(drained, outputs, done, self.defer_text)
                with self._lock:
                    launch = phases.schedule(outputs)
                    if launch is not None:
                        launch = phases.restore(launch)
                    if launch is not None:
                        launch = phases.build(launch, outputs)
                if launch is not None:
                    launch = phases.run(launch, outputs)
                if self.async_scheduling or (self.spec_async and launch is not None and not launch.has_proposals()):
                    prev, self._in_flight = self._in_flight, launch
                else:
                    if self._in_flight is not None:  # spec_async: an older step's tokens come first
                        drained, self._in_flight = self._in_flight, None
                        phases.update(drained, outputs, done, self.defer_text)
                    prev, launch = launch, None
                if prev is not None:
                    phases.update(prev, outputs, done, self.defer_text)
            except BaseException:
                with self._lock:  # an interrupt: nothing taken is lost, nothing in flight half-known
                    lost = [x for x in (drained, self._in_flight, prev, launch) if x is not None]
                    self.scheduler.rewind([sch for x in lost for sch in x.scheduled()], done)
                    self._in_flight = None
                    self._outbox[:0] = outputs
                raise
        return outputs

