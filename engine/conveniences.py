"""Engine conveniences over add_request / step: generate, stream, stats.

A mixin of Engine (engine/engine.py): these call only its public methods, its lock and
its outbox, and change no request state themselves.
"""

from __future__ import annotations

from typing import Iterator

from jaxfill.engine.request import Completion, InvalidRequest, QueueFull, RequestOutput, SamplingParams


class Conveniences:
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
                for req in self._requests_of(rid):
                    self._finish(req, "abort")
            self._outbox = [o for o in self._outbox if o.request_id not in ids and o.parent_id not in ids]

    def stream(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
               priority: int = 0) -> Iterator[RequestOutput]:
        """Adds one request and steps the engine until it finishes, yielding its chunks.
        Outputs of other requests go back to the outbox for whoever steps next. If the
        stream is closed early or raises, its request is aborted and its outputs dropped."""
        self._guard.refuse_others()
        rid = self.add_request(prompt, params, request_id, priority)
        left = (params.n if params else 1)  # samples not finished yet (outputs carry .index)
        done = False
        try:
            while not done:
                outs = self.step()
                others = [o for o in outs if o.request_id != rid and o.parent_id != rid]
                if others:
                    with self._lock:
                        self._outbox.extend(others)
                for out in (o for o in outs if o.request_id == rid or o.parent_id == rid):
                    left -= out.finished
                    done = left == 0
                    yield out
        finally:
            if not done:
                self._discard([rid])

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 priority: int = 0) -> list[Completion]:
        """Runs the prompts to completion: one Completion per sample, a prompt's n samples
        side by side (Completion.index). Every prompt is checked before any is added; on
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
                checked.append(self.factory.check(prompt, p, priority))
            except InvalidRequest as e:
                raise InvalidRequest(e.field, f"prompt {i}: {str(e).removeprefix(e.field + ': ')}") from None
        self._guard.refuse_others()
        rids: list[str] = []
        samples: list[str] = []  # the ids outputs carry, per sample
        results: dict[str, Completion] = {}
        total = sum(p.n for _, p in checked)
        try:
            while len(rids) < len(checked) or len(results) < total:
                while len(rids) < len(checked):
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
                if others:
                    with self._lock:
                        self._outbox.extend(others)
            return [results[r] for r in samples]
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
                "weight_bytes": self.runner.weight_bytes,  # all params, global shapes
                "kv_cache_dtype": self.settings.kv_cache_dtype,
                # kv_cache_bytes (values + scales + state slots, all shards),
                # kv_cache_bytes_per_device, kv_bytes_per_token, state_bytes: fixed at build
                **self.runner.kv_sizes,
                "compiled_programs": self.runner.cache_size(),
                **(self.runner.expert_load.summary() if self.runner.expert_load else {}),
                **self._host_tier_stats(),
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
            with self._lock:
                return self.runner.expert_totals()
        with self._guard.claim():
            return self.runner.expert_totals(refresh=True)

    def set_kv_event_listener(self, listener) -> None:
        """listener(replica, *event) hears every data replica's prefix-cache events
        (engine/block_manager.py) on the stepping thread, and the host tier's, which end
        with the tier's name (engine/kv_tier/host.py); None removes it."""
        with self._lock:
            self.scheduler.set_listener(listener)
            if self.runner.kv_offload is not None:  # the host tier is one for all replicas: replica 0's events
                tier = self.runner.kv_offload.tier
                tier.listener = None if listener is None else (lambda *ev: listener(0, *ev))
