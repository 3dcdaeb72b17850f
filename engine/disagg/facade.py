"""The Engine's face for disaggregated prefill (engine/disagg/handoff.py does the work).

Prefill side: `hold_pages` before the request finishes, `take_kv_offer` after it, and
`release_held` once the decode side has pulled. Decode side: `add_prefilled_request`
with the pulled rows. A mixin of Engine: every call takes the engine lock.
"""

from __future__ import annotations

from jaxfill.engine.request import InvalidRequest, SamplingParams


class DisaggregationFacade:
    def enable_kv_transfer(self, host: str = "127.0.0.1"):
        """Starts this engine's transfer server (engine/disagg/handoff.py); idempotent."""
        from jaxfill.engine.disagg.handoff import KVHandoff  # jax.experimental.transfer only when asked

        with self._lock:
            if self.kv_handoff is None:
                self.kv_handoff = KVHandoff(self.settings.kv_transfer_timeout_s, self.config, self.runner,
                                            self.scheduler, host)
            return self.kv_handoff

    def hold_pages(self, request_id: str) -> None:
        """Prefill side: when this request finishes, its prompt's pages are kept and offered;
        `take_kv_offer` then gives what the decode side needs."""
        with self._lock:
            self.enable_kv_transfer().hold.add(request_id)
            if self.settings.state_slots:  # a hybrid also sends its state at the rows' end
                self.scheduler.hold_state(request_id)

    def held_page_share(self) -> float:
        """Prefill side: the share of the pool held for transfers not yet pulled, plus the
        prompts marked to be held that are still running (their pages will be held)."""
        with self._lock:
            if self.kv_handoff is None:
                return 0.0
            held = sum(len(h.pages) for h in self.kv_handoff.held.values())
            running = self.kv_handoff.hold & set(self.requests)
            held += sum(len(self.requests[rid].pages) for rid in running)
            return held / max(1, self.scheduler.stats()["pages_total"])  # host-side counts only

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
        handoff = self.enable_kv_transfer()
        if self.runner.num_replicas != 1:
            raise InvalidRequest("kv_transfer_params", "prefilled requests need mesh.data = 1")
        ids, params = self.factory.check(prompt, params, priority)
        with self._lock:
            if request_id in self.requests:
                raise InvalidRequest("request_id", f"{request_id!r} is already in flight")
            pages, slot = handoff.import_pulled(arrays, num_tokens)
            try:
                req = self.factory.new(ids, params, request_id, priority, with_text=not self.defer_text)
            except BaseException:
                self.scheduler.free_pages(pages, state_slot=slot)
                raise
            self.scheduler.admit_prefilled(req, pages, num_tokens, cached_tokens, slot)
        return request_id
