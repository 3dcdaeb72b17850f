"""Engine: what a notebook, a benchmark or the serving loop holds.

    engine = Engine.from_config("tiny")
    completions = engine.generate(["Hello"], SamplingParams(max_tokens=8))

A front end over `engine.core` (engine/core.py, EngineCore: the queues, the lock, the
outbox and the step; engine/step_phases.py: what one step does). This class adds what is
built from the core's public methods only (tests/test_state_ownership.py checks): generate,
stream, stats, abort_all, the multi-process calls and the disaggregation names. Its
collaborators (runner, scheduler, factory, disagg, ...) are the core's, read-only here.

Multi-process (jax.distributed): process 0 owns the scheduler and drives it; the others
call `follow()` and run each step it broadcasts (engine/lockstep.py) until process 0
calls `close()`:

    with Engine.from_config(cfg) as engine:
        if engine.is_leader:
            completions = engine.generate(prompts)
        else:
            engine.follow()
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from jaxfill.engine.assembly import assemble
from jaxfill.engine.config import Config, load_config
from jaxfill.engine.core import EngineCore
from jaxfill.engine import live_weights
from jaxfill.engine import sleep as sleep_mode
from jaxfill.engine.pooling import api as pooling_api
from jaxfill.engine.request import (Completion, InvalidRequest, PoolingParams, QueueFull, RequestOutput,
                                   SamplingParams)
from jaxfill.engine.sleep import EngineAsleep, SleepState  # noqa: F401 (EngineAsleep: the Engine's exception)


def _core_attr(name: str, doc: str = "", writable: bool = False) -> property:
    """engine.<name> is engine.core.<name>: one object, so a write (where allowed) is the core's."""
    def write(self, value):
        setattr(self.core, name, value)
    return property(lambda self: getattr(self.core, name), write if writable else None, doc=doc)


class Engine:
    # The core's collaborators and counters, under the names users and the serving layer use.
    config = _core_attr("config", "The Config as built (engine.num_pages = 0 resolved, a CPU split's mesh).")
    settings = _core_attr("settings", "config.engine.")
    runner = _core_attr("runner", "Params, KV cache, mesh, compiled steps (engine/runner.py).")
    scheduler = _core_attr("scheduler", "The one owner of request state (engine/scheduler/).")
    factory = _core_attr("factory", "Prompt checks, request ids, seeds (engine/request_factory.py).")
    disagg = _core_attr("disagg", "Disaggregated prefill (engine/disagg/facade.py).")
    shapes = _core_attr("shapes", "The (tokens, seqs) buckets the warm-up compiles.")
    max_pages = _core_attr("max_pages", "engine.max_pages_per_seq.")
    vocab_size = _core_attr("vocab_size")
    requests = _core_attr("requests", "Unfinished requests by id (the scheduler's registry): read it, never write it.")
    tokenizer = _core_attr("tokenizer", "Encodes string prompts and detokenizes outputs (the request factory's).",
                           writable=True)
    defer_text = _core_attr("defer_text", "True: step() leaves text and logprob formatting to the caller (a serving "
                            "loop, serving/text_stage.py); outputs carry ids and raw_logprobs.", writable=True)
    is_leader = _core_attr("is_leader", "Process 0 of a multi-process run (or the only process): owns the scheduler.")
    num_steps = _core_attr("num_steps")
    num_errors = _core_attr("num_errors")
    num_cache_resets = _core_attr("num_cache_resets")
    warmed_up = _core_attr("warmed_up", writable=True)  # a server's test holds it back (tests/test_serving_vllm.py)
    warmup_s = _core_attr("warmup_s")
    warmup_programs = _core_attr("warmup_programs", "(loaded from the compile cache, compiled) at warm-up.")

    def __init__(self, config: Config, progress: bool = True, warmup: bool = True, model=None,
                 defer_text: bool = False, compile_cache: str | None = "default"):
        """`compile_cache`: the persistent XLA cache directory ("default": $JAXFILL_COMPILE_CACHE,
        $JAX_COMPILATION_CACHE_DIR or ~/.cache/jaxfill/xla, as the CLI uses; None: off, which
        the CLI passes for --compile-cache none). With "default", a cache jax is already
        configured with is left as it is."""
        self.core = EngineCore(assemble(config, model, progress, compile_cache), defer_text=defer_text)
        self._sleep = SleepState()  # Engine.sleep / wake (engine/sleep.py)
        if warmup and self.is_leader:  # followers compile as they follow the leader's warm-up
            self.warmup(progress)

    @classmethod
    def from_config(cls, config=None, model_path=None, overrides=None, progress: bool = True,
                    defer_text: bool = False, compile_cache: str | None = "default") -> "Engine":
        """`config`: a TOML path or preset name; None: with `model_path`, the engine settings
        from the checkpoint (engine/checkpoint_settings.py), else "tiny"."""
        return cls(load_config(config, overrides, model_path), progress=progress, defer_text=defer_text,
                   compile_cache=compile_cache)

    # ------------------------------------------------------------------ the core's calls
    def warmup(self, progress: bool = True, buckets: bool = True) -> None:
        """Compiles every (tokens, seqs) bucket before the engine reports ready. `buckets=False`
        checks the attention impl only; each bucket then compiles when a step first needs it
        (a one-shot `generate` uses one or two of the six a checkpoint run has)."""
        self.core.warmup(progress, buckets)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, after: str | None = None, replica: int | None = None) -> str:
        """Queues a request; returns its id (for n > 1, the id that names its samples).
        after: the id of an unfinished request with the same prompt (a sample fanned out by
        the caller): this one waits until that one has prefilled, then shares its cached
        prompt pages. replica: the data replica to run on (the protocol's data_parallel_rank;
        None: the engine places it). While the engine sleeps: EngineAsleep."""
        sleep_mode.refuse_if_asleep(self._sleep, "add_request")
        return self.core.add_request(prompt, params, request_id, priority, after, replica)

    @staticmethod
    def sample_ids(request_id: str, n: int) -> list[str]:
        """The ids the outputs of add_request(..., SamplingParams(n=n)) carry."""
        return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]

    def abort(self, request_id: str) -> bool:
        """Frees the request's pages now; it finishes with "abort" at the next step(). The id
        add_request returned for n > 1 samples aborts them all; a sample's own id, that one."""
        return self.core.abort(request_id)

    def stop_at(self, request_id: str, num_tokens: int) -> bool:
        """defer_text: a stop string ended the request at its first num_tokens tokens (the
        caller found it in the text); it finishes with "stop" now, pages freed, and its final
        output comes with the next step()."""
        return self.core.stop_at(request_id, num_tokens)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One step: every request's next chunk or token (engine/core.py)."""
        return self.core.step()

    @contextlib.contextmanager
    def own_stepping(self, defer_text: bool | None = None):
        """While inside, only the calling thread may step (a serving loop): another thread's
        step()/generate()/stream() is refused even between two of the owner's steps.
        `defer_text` sets the text mode for that time (the owner adds every request)."""
        with self.core.own_stepping(defer_text):
            yield self

    # ------------------------------------------------------------------ conveniences
    def abort_all(self) -> int:
        """Aborts every unfinished request and drops every output not yet returned (after an
        interrupted notebook cell, say); returns how many requests were aborted."""
        return self.core.discard(None)

    def stream(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
               priority: int = 0) -> Iterator[RequestOutput]:
        """Adds one request and steps the engine until it finishes, yielding its chunks.
        Outputs of other requests go back to the outbox for whoever steps next. If the
        stream is closed early or raises, its request is aborted and its outputs dropped."""
        self.core.refuse_other_steppers()
        rid = self.add_request(prompt, params, request_id, priority)
        left = (params.n if params else 1)  # samples not finished yet (outputs carry .index)
        done = False
        try:
            while not done:
                outs = self.step()
                self.core.return_outputs([o for o in outs if o.request_id != rid and o.parent_id != rid])
                for out in (o for o in outs if o.request_id == rid or o.parent_id == rid):
                    left -= out.finished
                    done = left == 0
                    yield out
        finally:
            if not done:
                self.core.discard([rid])

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 priority: int = 0) -> list[Completion]:
        """Runs the prompts to completion: one Completion per sample, a prompt's n samples
        side by side (Completion.index). Every prompt is checked before any is added; on
        any exception (KeyboardInterrupt included) its requests are aborted and their
        outputs dropped, then the exception propagates."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise InvalidRequest("params", f"{len(params)} SamplingParams for {len(prompts)} prompts")
            plist = list(params)
        else:
            plist = [params or SamplingParams()] * len(prompts)
        checked = []
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            try:
                checked.append(self.factory.check(prompt, p, priority))
            except InvalidRequest as e:
                raise InvalidRequest(e.field, f"prompt {i}: {str(e).removeprefix(e.field + ': ')}") from None
        self.core.refuse_other_steppers()
        rids: list[str] = []
        samples: list[str] = []  # the ids outputs carry, per sample
        results: dict[str, Completion] = {}
        total = sum(p.n for _, p in checked)
        try:
            while len(rids) < len(checked) or len(results) < total:
                while len(rids) < len(checked):  # as many as the queue takes (engine.max_waiting)
                    ids, p = checked[len(rids)]
                    try:
                        rids.append(self.add_request(ids, p, priority=priority))
                    except QueueFull:
                        break
                    samples += self.sample_ids(rids[-1], p.n)
                mine = set(samples)
                others = []
                for out in self.step():
                    if out.request_id not in mine:
                        others.append(out)
                    elif out.finished:
                        results[out.request_id] = out.completion
                self.core.return_outputs(others)
            return [results[r] for r in samples]
        except BaseException:
            self.core.discard(rids)
            raise

    # ------------------------------------------------------------------ LoRA adapters (engine/lora/)
    def load_lora(self, name: str, path: str) -> dict:
        """Reads a PEFT LoRA directory under `name` (requests name it in SamplingParams.lora);
        it reaches a device slot when a request first uses it. InvalidRequest / AdapterError
        name what is refused."""
        return self.core.lora_call("load", name, path)

    def unload_lora(self, name: str) -> bool:
        """Forgets an adapter (refused while unfinished requests use it); False if unknown."""
        return self.core.lora_call("unload", name)

    def list_loras(self) -> list[dict]:
        """Loaded adapters: name, path, device slot (0 = not on the device), on_host."""
        return self.core.lora_call("list")

    # ------------------------------------------------------------------ pooling (engine/pooling/)
    def embed(self, inputs, pooling: str | None = None, normalize: bool | None = None) -> list:
        """One numpy float32 [hidden] vector per input (a string or a list of token ids): its
        final-norm hidden states pooled ("last", "mean", "cls"; default model.pooling) and
        L2-normalized if asked (default model.normalize_embeddings). Prefill only, batched
        with whatever else is running; each input's pages go back when it is done."""
        return pooling_api.embed(self, inputs, pooling, normalize)

    def add_pooling_request(self, prompt_ids: list[int], pooling: PoolingParams, request_id: str | None = None) -> str:
        """Queues one pooling request for whoever steps (a serving loop): it is prefilled,
        never decoded, and its final output's `completion.embedding` is its vector. Checked
        as `embed` checks its inputs (InvalidRequest, nothing queued)."""
        ids = self.factory.check_pooling(prompt_ids, pooling)
        sleep_mode.refuse_if_asleep(self._sleep, "add_pooling_request")
        return self.core.add_pooling_request(ids, pooling, request_id)

    def score(self, query, documents) -> list[float]:
        """One number per document: p(yes) of a reranker (model.score_token_ids), else the
        cosine of the query's and the document's embeddings."""
        return pooling_api.score(self, query, documents)

    def stats(self) -> dict:
        with self.core.locked():  # one moment of the scheduler's counts and the step's
            return {
                **self.scheduler.stats(),
                "page_size": self.settings.page_size,
                "buckets": len(self.shapes),
                "bucket_shapes": list(self.shapes),
                "num_steps": self.num_steps,
                "num_errors": self.num_errors,
                "num_cache_resets": self.num_cache_resets,
                "attention_impl": self.runner.attention_impl,  # what serves, after the warm-up check
                "weight_bytes": self.runner.weight_bytes,  # all params, global shapes
                "kv_cache_dtype": self.settings.kv_cache_dtype,
                # kv_cache_bytes (values + scales + state slots, all shards),
                # kv_cache_bytes_per_device, kv_bytes_per_token, state_bytes: fixed at build
                **self.runner.kv_sizes,
                "compiled_programs": self.runner.cache_size(),
                **(self.runner.expert_load.summary() if self.runner.expert_load else {}),
                **self._host_tier_stats(),
                "sleeping": self._sleep.level,  # 0 awake, 1 KV pool released, 2 weights too
                # params + KV pool + step state on this process's devices (what sleep released not counted)
                "device_bytes": sleep_mode.engine_device_bytes(self.runner, self._sleep.level),
                **(self.core.lora.stats() if self.core.lora is not None else {}),
                **(self.runner.vision.stats() if self.runner.vision is not None else {}),  # engine/vision/
            }

    def _host_tier_stats(self) -> dict:
        """The host (and disk) KV tier's usage and hits; zeros when it is off."""
        offload = self.runner.kv_offload
        if offload is None:
            return {"host_kv_cache_bytes": 0, "host_kv_pages_used": 0, "host_kv_hit_tokens": 0}
        out = offload.stats()
        out["host_kv_hit_tokens"] = out["host_kv_hits"] * self.settings.page_size
        if "disk_kv_hits" in out:
            out["disk_kv_hit_tokens"] = out["disk_kv_hits"] * self.settings.page_size
        return out

    def expert_tokens(self, refresh: bool = False) -> dict:
        """MoE models: layer -> per-expert (token, expert) pairs routed since start, as
        numpy int64 [E] ({} for a dense model). stats() reports the newest copy that has
        reached the host; `refresh` copies the counters now and waits (one process only;
        it reads the cache, so like a step it is refused while another thread steps)."""
        if not refresh:
            with self.core.locked():
                return self.runner.expert_totals()
        with self.core.claim_stepping():
            return self.runner.expert_totals(refresh=True)

    def set_kv_event_listener(self, listener) -> None:
        """listener(replica, *event) hears every data replica's prefix-cache events
        (engine/block_manager.py) on the stepping thread, and the host tier's, which end
        with the tier's name (engine/kv_tier/host.py); None removes it."""
        with self.core.locked():
            self.scheduler.set_listener(listener)
            if self.runner.kv_offload is not None:  # the host tier is one for all replicas: replica 0's events
                tier = self.runner.kv_offload.tier
                tier.listener = None if listener is None else (lambda *ev: listener(0, *ev))

    # ------------------------------------------------------------------ weights that change (engine/live_weights.py)
    def update_weights(self, source, *, in_flight: str = "finish") -> dict:
        """New weights without a rebuild or a recompile: `source` is a params tree of this
        engine's structure, a checkpoint directory (loaded with the same checks, dtype,
        quantization and shards as at build), or an iterable of (HF tensor name, array)
        pairs (the params they name replaced, the rest kept). Everything is checked before
        anything changes (WeightUpdateError, one line naming the tensor). Requests in flight
        finish on the old weights first ("finish") or end with finish_reason "abort"
        ("abort"); then the prefix cache and the host/disk KV tiers are emptied and the old
        device buffers deleted. A model passed to Engine(model=...) shares those buffers:
        it is unusable after. Old and new weights are both on the device during the swap.
        Multi-process: a checkpoint path, which every process loads its shards of.
        Returns {"params_replaced", "freed_bytes", "seconds"}."""
        return live_weights.update_weights(self, self._sleep, source, in_flight)

    def sleep(self, level: int = 1, discard: bool = False) -> dict:
        """Gives device memory back, keeping every compiled program: level 1 deletes the KV
        pool (prefix cache emptied), level 2 the weights too (kept as host numpy, or with
        `discard` reloaded from the checkpoint at wake). Refused while requests are
        unfinished. Until wake(), add_request raises EngineAsleep. Returns {"freed_bytes"}."""
        return sleep_mode.sleep(self, self._sleep, level, discard)

    def wake(self) -> dict:
        """Restores what sleep() released, placed as before: no program compiles again."""
        return sleep_mode.wake(self, self._sleep)

    @property
    def sleeping(self) -> int:
        """0 awake, else the sleep level."""
        return self._sleep.level

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
                              num_tokens: int, cached_tokens: int = 0, priority: int = 0,
                              replica: int | None = None) -> str:
        self.core.require_leader("add_prefilled_request")
        return self.disagg.add_prefilled(prompt, params, request_id, arrays, num_tokens, cached_tokens, priority,
                                         with_text=not self.defer_text, replica=replica)

    # ------------------------------------------------------------------ multi-process
    def follow(self) -> int:
        """Processes 1..N-1: run process 0's steps (warm-up included) until it calls close()."""
        return self.runner.follow()

    def idle(self) -> None:
        """Call when there is nothing to step (the serving loop does): keeps followers alive."""
        self.runner.idle()

    def close(self) -> None:
        """Process 0: releases the followers. A no-op in a single-process run; idempotent."""
        self.runner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
