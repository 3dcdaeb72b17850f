"""The engine's side of disaggregated prefill: held pages, offers, and prefilled admissions.

Prefill side: a request marked with `hold` keeps its pages when it finishes; its first
len(prompt) - 1 rows are gathered and offered on the TransferAgent, and the pages stay
allocated (so the pool, and with it admission, accounts for every prompt not yet
pulled) until `release(transfer id)` or `engine.kv_transfer_timeout_s`. The last prompt
token is never sent: the decode side computes it as a one-token chunk, which draws the
first output token with the request's own seed, output index and logprobs, exactly as
an engine doing both would.

Decode side: `admit` allocates pages for the pulled rows, scatters them into its own
pool (engine/kv_transfer.py) and starts the request running with those tokens counted
as computed. Offers, releases and admissions run under the engine lock, and export and
admit on the stepping thread, since both touch the donated KV cache; `pull` only starts
the transfer (off the lock) and never touches the cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import time

from jaxfill.engine import kv_transfer as kvt
from jaxfill.engine.request import InvalidRequest, QueueFull, Request, Status


def prompt_digest(ids) -> str:
    """A short hash of token ids: the decode side checks it got the prompt it was sent."""
    return hashlib.blake2b(struct.pack(f"<{len(ids)}q", *ids), digest_size=8).hexdigest()


@dataclasses.dataclass
class Held:
    request_id: str
    pages: list[int]
    deadline: float  # time.monotonic()


class KVHandoff:
    def __init__(self, engine, host: str = "127.0.0.1"):
        self.engine = engine
        self.agent = kvt.TransferAgent(host)
        self.timeout_s = float(engine.settings.kv_transfer_timeout_s)
        self.hold: set[str] = set()  # request ids whose pages outlive their finish
        self.held: dict[int, Held] = {}  # transfer id -> pages kept for the pull
        self.offers: dict[str, dict] = {}  # request id -> what the decode side needs
        self.num_released = 0
        self.num_expired = 0
        # The cache's layout never changes: computed once, compared with every offer.
        self.layout = kvt.Layout.of(engine.config, engine.runner.kv_cache)

    # ------------------------------------------------------------------ prefill side
    def take_on_finish(self, req: Request, reason: str) -> None:
        """[lock, stepping thread] Called as a held request finishes: keeps its pages and
        offers its rows, or (aborted, failed) lets them be freed as usual."""
        if req.request_id not in self.hold:
            return
        self.hold.discard(req.request_id)
        n = len(req.prompt_ids) - 1
        if reason not in ("stop", "length") or req.num_computed < n:
            return
        e = self.engine
        layout = self.layout
        info = {"num_tokens": n, "prompt_digest": prompt_digest(req.prompt_ids[:n]),
                "cached_tokens": int(req.cached_tokens or 0), "layout": layout.to_json(),
                "transfer_address": self.agent.address}
        if n > 0:
            values, scales = kvt.export_rows(e.runner.kv_cache, req.pages, n, e.settings.page_size,
                                             layout.num_kv_heads)
            arrays = [values] + ([] if scales is None else [scales])
            tid = self.agent.offer(arrays, self.timeout_s)
            info["transfer_id"] = tid
            info["arrays"] = [[list(a.shape), str(a.dtype)] for a in arrays]
            self.held[tid] = Held(req.request_id, req.pages, time.monotonic() + self.timeout_s)
            req.pages = []  # kept: the scheduler's remove() frees nothing
        self.offers[req.request_id] = info

    def release(self, tid: int) -> bool:
        """[lock] The pull is done (or given up): the pages go back to the pool."""
        held = self.held.pop(tid, None)
        if held is None:
            return False
        self.offers.pop(held.request_id, None)  # nobody will take it any more
        self.engine.scheduler.replicas[0].bm.free(held.pages)
        self.num_released += 1
        return True

    def expire(self, now: float | None = None) -> int:
        """[lock] Frees the pages of offers nobody pulled within kv_transfer_timeout_s."""
        now = time.monotonic() if now is None else now
        late = [tid for tid, h in self.held.items() if h.deadline <= now]
        for tid in late:
            self.release(tid)
        self.num_expired += len(late)
        return len(late)

    # ------------------------------------------------------------------ decode side
    def pull(self, info: dict, prompt_ids: list[int]) -> tuple[list, int]:
        """Checks the offer against this engine and the prompt, starts the pull: (arrays
        becoming ready, num_tokens). Raises TransferFailed when they cannot fit."""
        n = int(info.get("num_tokens", -1))
        if n != len(prompt_ids) - 1:
            raise kvt.TransferFailed(f"the offer holds {n} tokens; this prompt needs {len(prompt_ids) - 1}")
        if info.get("prompt_digest") != prompt_digest(prompt_ids[:n]):
            raise kvt.TransferFailed("the offered KV belongs to a different prompt (digest mismatch)")
        mine = self.layout.to_json()
        if info.get("layout") != mine:
            raise kvt.TransferFailed(f"KV layout {info.get('layout')} does not match this engine's {mine}")
        if n == 0:
            return [], 0
        specs = [(tuple(s), d) for s, d in info["arrays"]]
        return self.agent.pull(info["transfer_address"], int(info["transfer_id"]), specs), n

    def admit(self, prompt_ids: list[int], params, request_id: str, arrays: list, num_tokens: int,
              cached_tokens: int = 0, priority: int = 0) -> str:
        """[stepping thread] A request whose first num_tokens rows are in `arrays` (ready):
        pages allocated, rows scattered in, and it runs on from its last prompt token."""
        e = self.engine
        if e.runner.num_replicas != 1:
            raise InvalidRequest("kv_transfer_params", "prefilled requests need mesh.data = 1")
        ids, params = e._check_request(prompt_ids, params, priority)
        with e._lock:
            if request_id in e.requests:
                raise InvalidRequest("request_id", f"{request_id!r} is already in flight")
            sched = e.scheduler.replicas[0]
            if len(sched.running) >= sched.max_seqs:
                raise QueueFull(f"{len(sched.running)} requests running (engine.max_num_seqs)")
            if num_tokens and arrays[0].shape[1] < num_tokens:
                raise kvt.TransferFailed(f"the pulled rows hold {arrays[0].shape[1]} tokens, not {num_tokens}")
            need = sched.bm.pages_for(num_tokens)
            if not sched.bm.can_allocate(need):
                raise QueueFull(f"{need} pages for a prefilled prompt; {sched.bm.num_free} free")
            pages = sched.bm.allocate(need)
            if num_tokens:
                values, scales = arrays[0], (arrays[1] if len(arrays) > 1 else None)
                try:
                    e.runner.kv_cache = kvt.import_rows(e.runner.kv_cache, values, scales, pages, num_tokens,
                                                        e.settings.page_size)
                except BaseException:
                    sched.bm.free(pages)
                    raise
            seed = params.seed if params.seed is not None else e._seeds.getrandbits(63)
            req = Request(request_id, ids, params, priority, next(e._arrivals), seed,
                          eos_token_ids=e.config.model.eos_token_id or ())
            req.detok = None if getattr(e, "defer_text", False) else e.tokenizer.detokenizer(ids)
            req.pages = pages
            req.num_computed = num_tokens
            req.cached_tokens = cached_tokens
            req.first_scheduled = time.perf_counter()
            req.status = Status.RUNNING
            e.requests[request_id] = req
            sched.running.append(req)
            sched.register_computed(req)
            e.scheduler.num_added[0] += 1
        return request_id
