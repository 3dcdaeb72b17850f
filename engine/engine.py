"""Engine: requests in, one step at a time, outputs out.

    engine.step():
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
and logprob formatting to the caller (serving/text_stage.py, Engine.stop_at).

One thread steps (engine/stepping.py); add_request / abort may come from any thread (one
lock guards the queues; the device call runs outside it). A request whose step fails
finishes with "error", pages freed, and the engine goes on; an interrupt (KeyboardInterrupt
in a notebook) leaves it consistent: outputs go back to the outbox, lost steps are
rewound, a KV cache lost between donation and store is rebuilt. mesh.data = R > 1: R
schedulers and page pools whose batches are stacked into one step. Multi-process
(jax.distributed): process 0 owns the scheduler and drives it; the others call
`follow()` (engine/multiprocess_facade.py).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback

from jaxfill.engine.async_step import Launch
from jaxfill.engine.batch import bucket_shapes, build_batch, describe_buckets, pick_bucket, stack_batches
from jaxfill.engine.config import Config, load_config
from jaxfill.engine.conveniences import Conveniences
from jaxfill.engine.cpu_devices import use_cpu_cores
from jaxfill.engine.compile_cache import use_compile_cache, warmup_summary
from jaxfill.engine.disagg.facade import Disaggregation
from jaxfill.engine.kv_tier.page_offload import build_kv_offload
from jaxfill.engine.kv_tier.restore import restore_rows
from jaxfill.engine.loading import build_mesh, build_model, build_tokenizer
from jaxfill.engine.mesh import with_mesh_shape
from jaxfill.engine.multiprocess_facade import MultiProcessFacade
from jaxfill.engine.output import record_prompt_logprobs, token_output
from jaxfill.engine.request import QueueFull, Request, RequestOutput, SamplingParams
from jaxfill.engine.request_factory import RequestFactory
from jaxfill.engine.runner import Runner
from jaxfill.engine.scheduler import ReplicaScheduler
from jaxfill.engine.stepping import StepGuard
from jaxfill.engine.tokenizer import IdsOnlyTokenizer


class Engine(Conveniences, MultiProcessFacade):
    def __init__(self, config: Config, progress: bool = True, warmup: bool = True, model=None,
                 defer_text: bool = False, compile_cache: str | None = "default"):
        """`compile_cache`: the persistent XLA cache directory ("default": $JAXFILL_COMPILE_CACHE,
        $JAX_COMPILATION_CACHE_DIR or ~/.cache/jaxfill/xla, as the CLI uses; None: off, which
        the CLI passes for --compile-cache none). With "default", a cache jax is already
        configured with is left as it is."""
        use_cpu_cores(config.mesh)  # first: one XLA CPU device per core, before jax starts
        use_compile_cache(compile_cache)
        try:
            tokenizer = build_tokenizer(config)
        except ValueError as e:
            tokenizer = IdsOnlyTokenizer(str(e))
        mesh = build_mesh(config)
        config = with_mesh_shape(config, mesh)  # a CPU split's mesh.tensor
        if model is None:
            model = build_model(config, mesh, progress=progress)
        self.vocab_size = config.model.vocab_size
        self.shapes = bucket_shapes(config.engine, multiple_of=config.mesh.sequence)
        self.runner = Runner(config, model, mesh, self.shapes)
        self.config = config = self.runner.config  # engine.num_pages = 0 is resolved there
        self.settings = s = config.engine
        # engine.host_kv_cache_gb > 0: evicted prefix pages kept in host memory (and on disk)
        self.runner.kv_offload = offload = build_kv_offload(config, self.runner.kv_cache, self.runner.stages)
        self.scheduler = ReplicaScheduler(s, self.runner.num_replicas,  # one per mesh.data replica
                                          tier=offload and offload.tier, on_evict=offload and offload.on_evict,
                                          page_ranks=config.mesh.sequence)
        self.max_pages = s.max_pages_per_seq
        # True: step() leaves text and logprob formatting to the caller (a serving loop does
        # them off this thread, serving/text_stage.py); outputs carry ids and raw_logprobs.
        self.defer_text = bool(defer_text)
        self._lock = threading.RLock()
        self._outbox: list[RequestOutput] = []  # reported by the next step()
        self._guard = StepGuard(self._lock)  # one thread steps (engine/stepping.py)
        self.factory = RequestFactory(config, tokenizer, self.scheduler.requests)
        self._in_flight: Launch | None = None  # async scheduling: the step whose tokens are not yet taken
        self.num_steps = 0
        self.num_errors = 0
        self.num_cache_resets = 0
        self.warmed_up = False
        # disaggregated prefill (engine/disagg/): the hand-off starts with enable_kv_transfer()
        self.disagg = Disaggregation(self._lock, config, self.runner, self.scheduler, self.factory)
        if warmup and self.is_leader:  # followers compile as they follow the leader's warm-up
            self.warmup(progress)

    @classmethod
    def from_config(cls, config=None, model_path=None, overrides=None, progress: bool = True,
                    defer_text: bool = False, compile_cache: str | None = "default") -> "Engine":
        """`config`: a TOML path or preset name; None: with `model_path`, the engine settings
        from the checkpoint (engine/checkpoint_settings.py), else "tiny"."""
        return cls(load_config(config, overrides, model_path), progress=progress, defer_text=defer_text,
                   compile_cache=compile_cache)

    @property
    def tokenizer(self):
        """Encodes string prompts and detokenizes outputs (the request factory's)."""
        return self.factory.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        self.factory.tokenizer = tokenizer

    @property
    def requests(self) -> dict[str, Request]:
        """Unfinished requests by id (the scheduler's registry): read it, never write it."""
        return self.scheduler.requests

    # ------------------------------------------------------------------ disaggregated prefill
    # engine.disagg (engine/disagg/facade.py) does it; these names are the Engine's API.
    @property
    def kv_handoff(self):
        """The hand-off (engine/disagg/handoff.py), None until enable_kv_transfer()."""
        return self.disagg.handoff

    def enable_kv_transfer(self, host: str = "127.0.0.1"):
        return self.disagg.enable(host)

    def hold_pages(self, request_id: str) -> None:
        self.disagg.hold_pages(request_id)

    def held_page_share(self) -> float:
        return self.disagg.held_page_share()

    def take_kv_offer(self, request_id: str) -> dict | None:
        return self.disagg.take_offer(request_id)

    def release_held(self, transfer_id: int) -> bool:
        return self.disagg.release(transfer_id)

    def expire_held(self) -> int:
        return self.disagg.expire()

    def add_prefilled_request(self, prompt, params: SamplingParams | None, request_id: str, arrays: list,
                              num_tokens: int, cached_tokens: int = 0, priority: int = 0) -> str:
        self._leader_only("add_prefilled_request")
        return self.disagg.add_prefilled(prompt, params, request_id, arrays, num_tokens, cached_tokens, priority,
                                         with_text=not self.defer_text)

    def warmup(self, progress: bool = True) -> None:
        """Compiles every (tokens, seqs) bucket before the engine reports ready."""
        self._leader_only("warmup")
        if progress:
            print(f"jaxfill: preparing {describe_buckets(self.shapes)}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        with self._guard.claim():
            self.warmup_programs = self.runner.warmup(progress)  # (loaded from the cache, compiled)
        self.warmup_s = time.perf_counter() - start
        self.warmed_up = True
        if progress:
            print(f"jaxfill: {warmup_summary(*self.warmup_programs, self.warmup_s)}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, after: str | None = None) -> str:
        """Queues a request; returns its id (for n > 1, the id that names its samples).
        after: the id of an unfinished request with the same prompt (a sample fanned out by
        the caller): this one waits until that one has prefilled, then shares its cached
        prompt pages."""
        ids, params = self.factory.check(prompt, params, priority)
        self._leader_only("add_request")
        with self._lock:
            waiting = self.scheduler.num_waiting()
            if waiting >= self.settings.max_waiting:
                raise QueueFull(f"{waiting} requests waiting (engine.max_waiting)")
            if params.n == 1:
                req = self.factory.new(ids, params, request_id, priority, with_text=not self.defer_text)
                sibling = self.requests.get(after) if after is not None else None
                if sibling is not None and self.settings.enable_prefix_caching and sibling.prompt_ids == ids:
                    req.prefill_after = sibling
                self.scheduler.add(req)
                return req.request_id
            samples = self.factory.new_samples(ids, params, request_id, priority, not self.defer_text,
                                               share_prefill=self.settings.enable_prefix_caching)
            for req in samples:
                self.scheduler.add(req)
            return samples[0].parent_id

    @staticmethod
    def sample_ids(request_id: str, n: int) -> list[str]:
        """The ids the outputs of add_request(..., SamplingParams(n=n)) carry."""
        return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]

    def abort(self, request_id: str) -> bool:
        """Frees the request's pages now; it finishes with "abort" at the next step(). The id
        add_request returned for n > 1 samples aborts them all; a sample's own id, that one."""
        with self._lock:
            reqs = self._requests_of(request_id)
            for req in reqs:
                self._outbox.append(self._finish(req, "abort"))
            return bool(reqs)

    def _requests_of(self, request_id: str) -> list[Request]:
        """[lock] The unfinished request of that id, or the samples it names."""
        req = self.requests.get(request_id)
        if req is not None:
            return [req]
        return [r for r in self.requests.values() if r.parent_id == request_id]

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self.requests or self._outbox)

    def stop_at(self, request_id: str, num_tokens: int) -> bool:
        """defer_text: a stop string ended the request at its first num_tokens tokens (the
        caller found it in the text); it finishes with "stop" now, pages freed, and its final
        output comes with the next step()."""
        with self._lock:
            req = self.requests.get(request_id)
            if req is None:
                return False
            self._outbox.append(self._finish(req, "stop", num_output_tokens=num_tokens))
            return True

    # ------------------------------------------------------------------ step
    @contextlib.contextmanager
    def own_stepping(self, defer_text: bool | None = None):
        """While inside, only the calling thread may step (a serving loop): another thread's
        step()/generate()/stream() is refused even between two of the owner's steps.
        `defer_text` sets the text mode for that time (the owner adds every request)."""
        with self._guard.own():
            saved = self.defer_text
            if defer_text is not None:
                self.defer_text = bool(defer_text)
            try:
                yield self
            finally:
                self.defer_text = saved

    def step(self) -> list[RequestOutput]:
        """schedule -> build batch -> run -> update. With async scheduling step N+1 is
        dispatched before step N's tokens are taken; without, the step just dispatched is
        taken at once: the same code, one step at a time."""
        outputs: list[RequestOutput] = []
        with self._guard.claim():
            done: set[int] = set()  # id() of the Scheduled rows taken
            prev = launch = None
            try:
                with self._lock:
                    launch = self._schedule(outputs)
                    if launch is not None:
                        launch = self._restore(launch)
                    if launch is not None:
                        launch = self._build(launch, outputs)
                if launch is not None:
                    launch = self._run(launch, outputs)
                if self.settings.async_scheduling:
                    prev, self._in_flight = self._in_flight, launch
                else:
                    prev, launch = launch, None
                if prev is not None:
                    self._update(prev, outputs, done)
            except BaseException:
                with self._lock:  # an interrupt: nothing taken is lost, nothing in flight half-known
                    lost = [x for x in (self._in_flight, prev, launch) if x is not None]
                    self.scheduler.rewind([sch for x in lost for sch in x.scheduled()], done)
                    self._in_flight = None
                    self._outbox[:0] = outputs
                raise
        return outputs

    def _schedule(self, outputs: list[RequestOutput]) -> Launch | None:
        """[lock] The outbox, expired KV offers, a lost cache, then the scheduler's plan."""
        outputs += self._outbox
        self._outbox = []
        self.disagg.expire()
        self._recover_cache()
        if self.runner.kv_offload is not None:
            self.runner.kv_offload.poll()  # saves that reached the host join the tier
        scheds = self.scheduler.schedule()  # one per data replica
        for req in (r for sched in scheds for r in sched.finished):  # no room in the pool even alone
            self.disagg.forget(req.request_id)  # never prefilled: nothing to offer
            outputs.append(self._finished_output(req))
        if not self._copy_states(scheds) or not any(sched.seqs for sched in scheds):
            return None
        shape = pick_bucket(self.shapes, max(sc.num_tokens for sc in scheds), max(len(sc.seqs) for sc in scheds))
        return Launch(scheds, shape, None)

    def _copy_states(self, scheds) -> bool:
        """[lock] Linear-attention state snapshots taken and restored, and held prefills'
        states exported, before the step (even when nothing runs now: a snapshot is
        findable from now on). If the copy fails the
        cache is rebuilt and every request recomputes (no snapshot is then trusted)."""
        first = [c for sc in scheds for c in sc.state_copies]
        then = [c for sc in scheds for c in sc.state_restores]
        exports = [e for sc in scheds for e in sc.state_exports]  # held prefills' states (engine/disagg/handoff.py)
        saves = [x for sc in scheds for x in sc.state_saves]  # snapshots the copies push out, to the host tier
        if not first and not then and not exports and not saves:
            return True
        try:
            self.runner.save_states(saves)  # before the copies overwrite their slots
            if first or then:
                self.runner.copy_states(first, then)
            for request_id, slot in exports:
                self.disagg.keep_state(request_id, self.runner.export_state(slot))
            return True
        except Exception:  # noqa: BLE001 - the requests recompute; the engine goes on
            traceback.print_exc(file=sys.stderr)
            self.runner.reset_cache()
            self.scheduler.recompute_all()
            self.num_cache_resets += 1
            return False

    def _restore(self, launch: Launch) -> Launch | None:
        """[lock] Rows that hit the host tier get their pages (and a hybrid's snapshot) back
        before the step reads them (engine/kv_tier/restore.py); one that failed recomputes,
        and a cache lost on the way sends everyone back (_recover_cache)."""
        if restore_rows(self.runner, self.scheduler, launch.scheds):
            return launch
        if not self.runner.cache_ok():
            self._recover_cache()
            return None
        return launch if any(sc.seqs for sc in launch.scheds) else None

    def _build(self, launch: Launch, outputs: list[RequestOutput]) -> Launch | None:
        s = self.settings
        try:
            launch.batch = stack_batches([build_batch(sc, launch.shape, s.page_size, self.max_pages, self.vocab_size,
                                                      s.penalty_window, self.runner.prompt_rows, s.state_slots > 0)
                                          for sc in launch.scheds])
        except Exception as e:  # noqa: BLE001 - a bad request must not stop the engine
            outputs += self._fail(launch.scheds, e)
            return None
        return launch

    def _run(self, launch: Launch, outputs: list[RequestOutput]) -> Launch | None:
        try:
            launch.pending = self.runner.run(launch.batch)
        except Exception as e:  # noqa: BLE001
            with self._lock:
                outputs += self._fail(launch.scheds, e)
            return None
        with self._lock:
            self.scheduler.on_dispatch(launch.scheds, launch.shape[1])
        return launch

    def _update(self, launch: Launch, outputs: list[RequestOutput], done: set) -> None:
        """Step N's results reach the host: per row, the scheduler's update, then the text."""
        try:
            host = launch.pending.get()
        except Exception as e:  # noqa: BLE001
            with self._lock:
                outputs += self._fail(launch.scheds, e)
                return
        with self._lock:
            self.num_steps += 1
            now = time.perf_counter()
            if host.prompt is not None:
                record_prompt_logprobs(launch.scheds, host.prompt, self.runner.prompt_rows)
            for sch, row in launch.rows():
                req = sch.req
                try:
                    sampled = self.scheduler.update_from_output(sch, int(host.tokens[row]), now)
                    out = None if sampled is None else self._token_output(req, sampled, host, row)
                except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                    out = self._finish(req, "error", error=f"{type(e).__name__}: {e}")
                done.add(id(sch))
                if out is not None:
                    outputs.append(out)

    def _token_output(self, req: Request, sampled, host, row: int) -> RequestOutput:
        out, reason = token_output(req, sampled, host, row, self.defer_text)
        if reason is not None:
            out.finished, out.completion = True, self._finish(req, reason).completion
        return out

    def _recover_cache(self) -> None:
        """A step that died between donating the KV cache and storing its successor (an
        error, or an interrupt) leaves deleted buffers: start from a fresh cache and send
        the running requests back to be recomputed, so no later request fails for it."""
        if not self.runner.cache_ok():
            self.runner.reset_cache()
            self.scheduler.recompute_all()
            self.num_cache_resets += 1

    def _fail(self, scheds, exc: Exception) -> list[RequestOutput]:
        """The step raised: its requests finish with "error"; the engine carries on."""
        self.num_errors += 1
        msg = f"{type(exc).__name__}: {exc}"
        traceback.print_exc(file=sys.stderr)
        outs = [self._finish(sch.req, "error", error=msg)
                for sched in scheds for sch in sched.seqs if not sch.req.finished]
        self._recover_cache()
        return outs

    def _finish(self, req: Request, reason: str, error: str | None = None,
                num_output_tokens: int | None = None) -> RequestOutput:
        """[lock] Ends the request through the scheduler; a held prefill keeps its pages for
        the decode side's pull (engine/disagg/handoff.py)."""
        keep = self.disagg.take_on_finish(req, reason)
        self.scheduler.finish(req, reason, error, keep_pages=keep, num_output_tokens=num_output_tokens)
        return self._finished_output(req)

    @staticmethod
    def _finished_output(req: Request) -> RequestOutput:
        return RequestOutput(req.request_id, [], "", finished=True, completion=req.completion(), index=req.index,
                             parent_id=req.parent_id)

