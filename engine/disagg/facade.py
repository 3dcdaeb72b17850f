"""The Engine's collaborator for disaggregated prefill, `engine.disagg` (engine/disagg/
handoff.py does the work; the Engine keeps its old method names as one-line delegations).

Prefill side: `hold_pages` before the request finishes, `take_offer` after it, and
`release` once the decode side has pulled. Decode side: `add_prefilled` with the pulled
rows. Every call takes the engine lock; the step calls the hooks at the end ([lock]).
"""

from __future__ import annotations

from jaxfill.engine.request import InvalidRequest, Request, SamplingParams


class Disaggregation:
    def __init__(self, lock, config, runner, scheduler, factory):
        self._lock = lock  # the engine's: offers, releases and imports touch its scheduler and cache
        self.config = config
        self.settings = config.engine
        self.runner = runner
        self.scheduler = scheduler
        self.factory = factory
        self.handoff = None  # engine/disagg/handoff.py's KVHandoff, once enable() has run

    def enable(self, host: str = "127.0.0.1"):
        """Starts this engine's transfer server (engine/disagg/handoff.py); idempotent."""
        from jaxfill.engine.disagg.handoff import KVHandoff  # jax.experimental.transfer only when asked

        with self._lock:
            if self.handoff is None:
                self.handoff = KVHandoff(self.settings.kv_transfer_timeout_s, self.config, self.runner,
                                         self.scheduler, host)
            return self.handoff

    # ------------------------------------------------------------------ prefill side
    def hold_pages(self, request_id: str) -> None:
        """When this request finishes, its prompt's pages are kept and offered; `take_offer`
        then gives what the decode side needs."""
        with self._lock:
            self.enable().hold.add(request_id)
            if self.settings.state_slots:  # a hybrid also sends its state at the rows' end
                self.scheduler.hold_state(request_id)

    def held_page_share(self) -> float:
        """The share of the pool held for transfers not yet pulled, plus the prompts marked
        to be held that are still running (their pages will be held)."""
        with self._lock:
            if self.handoff is None:
                return 0.0
            requests = self.scheduler.requests
            held = sum(len(h.pages) for h in self.handoff.held.values())
            running = self.handoff.hold & set(requests)
            held += sum(len(requests[rid].pages) for rid in running)
            return held / max(1, self.scheduler.stats()["pages_total"])  # host-side counts only

    def take_offer(self, request_id: str) -> dict | None:
        with self._lock:
            return None if self.handoff is None else self.handoff.offers.pop(request_id, None)

    def release(self, transfer_id: int) -> bool:
        """The decode side has pulled (or given up): free the held pages."""
        with self._lock:
            return self.handoff is not None and self.handoff.release(int(transfer_id))

    def expire(self) -> int:
        """Frees held pages older than engine.kv_transfer_timeout_s; returns how many offers."""
        with self._lock:
            return 0 if self.handoff is None else self.handoff.expire()

    # ------------------------------------------------------------------ decode side
    def add_prefilled(self, prompt, params: SamplingParams | None, request_id: str, arrays: list,
                      num_tokens: int, cached_tokens: int = 0, priority: int = 0, with_text: bool = True,
                      replica: int | None = None) -> str:
        """Stepping thread: admits a request whose first num_tokens prompt rows were pulled
        into `arrays` (KVHandoff.pull); it continues from its last prompt token. The rows go
        to `replica`'s pool (data_parallel_rank), else to the replica place_prefilled picks."""
        handoff = self.enable()
        self.scheduler.check_replica(replica)
        ids, params = self.factory.check(prompt, params, priority)
        if params.lora is not None:  # the hand-off carries no adapter (engine/capabilities/table.py)
            raise InvalidRequest("lora", "prefilled (disaggregated) requests run the base model only")
        with self._lock:
            if request_id in self.scheduler.requests:
                raise InvalidRequest("request_id", f"{request_id!r} is already in flight")
            replica = self.scheduler.place_prefilled(num_tokens, replica)
            pages, slot = handoff.import_pulled(arrays, num_tokens, replica)
            try:
                req = self.factory.new(ids, params, request_id, priority, with_text=with_text)
            except BaseException:
                self.scheduler.free_pages(pages, replica, state_slot=slot)
                raise
            self.scheduler.admit_prefilled(req, pages, num_tokens, cached_tokens, slot, replica)
        return request_id

    # ------------------------------------------------------------------ the step's hooks
    def forget(self, request_id: str) -> None:
        """[lock] A request finished without ever prefilling: nothing to offer."""
        if self.handoff is not None:
            self.handoff.hold.discard(request_id)
            self.handoff.states.pop(request_id, None)

    def keep_state(self, request_id: str, arrays: list) -> None:
        """[lock] A held hybrid prefill's state, exported before the step moves on."""
        self.handoff.keep_state(request_id, arrays)

    def take_on_finish(self, req: Request, reason: str) -> bool:
        """[lock] True: the finishing request is a held prefill whose pages stay allocated
        for the decode side's pull (KVHandoff.take_on_finish)."""
        return self.handoff is not None and self.handoff.take_on_finish(req, reason)
