"""The engine's side of disaggregated prefill: held pages, offers, and prefilled admissions.

Prefill side: a request marked with `hold` keeps its pages when it finishes; its first
len(prompt) - 1 rows are gathered and offered on the TransferAgent, and the pages stay
allocated (so the pool, and with it admission, accounts for every prompt not yet
pulled) until `release(transfer id)` or `engine.kv_transfer_timeout_s`. The last prompt
token is never sent: the decode side computes it as a one-token chunk, which draws the
first output token with the request's own seed, output index and logprobs, exactly as
an engine doing both would.

A linear-attention hybrid also sends its recurrent state at those rows' end: the
scheduler ends a held prompt's chunk at len(prompt) - 1 and the state is exported
(`keep_state`) before the next step moves on; it travels after the rows.

Decode side: `import_pulled` reserves pages (and a hybrid's state slot) for the pulled
rows and writes them into its own pool; the engine then has the scheduler admit the request with those tokens
counted as computed (engine/disagg/facade.py `add_prefilled`). Offers, releases and imports run
under the engine lock, and export and import on the stepping thread, since both touch
the donated KV cache; `pull` only starts the transfer (off the lock) and never touches
the cache. Pages move only through the scheduler (reserve_prefilled, free_pages, and
finish(keep_pages=True) for a held prefill).
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import time

from jaxfill.engine import kv_rows
from jaxfill.engine.disagg import transfer
from jaxfill.engine.request import Request
from jaxfill.models.linear_state import state_row


def prompt_digest(ids) -> str:
    """A short hash of token ids: the decode side checks it got the prompt it was sent."""
    return hashlib.blake2b(struct.pack(f"<{len(ids)}q", *ids), digest_size=8).hexdigest()


@dataclasses.dataclass
class Held:
    request_id: str
    pages: list[int]  # ids in `replica`'s pool
    deadline: float  # time.monotonic()
    replica: int = 0  # the data replica whose pool holds them


class KVHandoff:
    def __init__(self, timeout_s: float, config, runner, scheduler, host: str = "127.0.0.1"):
        self.runner = runner
        self.scheduler = scheduler  # engine/scheduler/replicas.py: pages come and go through it
        self.page_size = config.engine.page_size
        self.pages_per_replica = runner.num_pages  # mesh.data: replica r's page p is r * this + p in the cache
        self.agent = transfer.TransferAgent(host)
        self.timeout_s = float(timeout_s)
        self.hold: set[str] = set()  # request ids whose pages outlive their finish
        self.held: dict[int, Held] = {}  # transfer id -> pages kept for the pull
        self.offers: dict[str, dict] = {}  # request id -> what the decode side needs
        self.states: dict[str, list] = {}  # request id -> a hybrid's exported state arrays (keep_state)
        self.num_released = 0
        self.num_expired = 0
        # The cache's layout never changes: computed once, compared with every offer.
        self.layout = kv_rows.Layout.of(config, runner.kv_cache)

    # ------------------------------------------------------------------ prefill side
    def take_on_finish(self, req: Request, reason: str) -> bool:
        """[lock, stepping thread] Called as a request finishes, before the scheduler frees
        its pages: a held one that computed its prompt has its rows offered and True says
        the pages stay allocated (kept here until released); otherwise False."""
        state = self.states.pop(req.request_id, None)  # a hybrid's, whatever happens next
        if req.request_id not in self.hold:
            return False
        self.hold.discard(req.request_id)
        n = len(req.prompt_ids) - 1
        if reason not in ("stop", "length") or req.num_computed < n:
            return False
        layout = self.layout
        info = {"num_tokens": n, "prompt_digest": prompt_digest(req.prompt_ids[:n]),
                "cached_tokens": int(req.cached_tokens or 0), "layout": layout.to_json(),
                "transfer_address": self.agent.address}
        if n == 0:
            self.offers[req.request_id] = info
            return False
        if layout.state and state is None:
            return False  # a hybrid's state at n was never exported: nothing consistent to offer
        values, scales = self.runner.export_rows(self.global_pages(req.pages, req.replica), n, layout.num_kv_heads)
        arrays = [values] + ([] if scales is None else [scales]) + (state or [])
        tid = self.agent.offer(arrays, self.timeout_s)
        info["transfer_id"] = tid
        info["arrays"] = [[list(a.shape), str(a.dtype)] for a in arrays]
        self.held[tid] = Held(req.request_id, list(req.pages), time.monotonic() + self.timeout_s, req.replica)
        self.offers[req.request_id] = info
        return True

    def keep_state(self, request_id: str, arrays: list) -> None:
        """[lock, stepping thread] A held hybrid prefill's state at len(prompt) - 1 (Runner.export_state)."""
        self.states[request_id] = arrays

    def release(self, tid: int) -> bool:
        """[lock] The pull is done (or given up): the pages go back to the pool."""
        held = self.held.pop(tid, None)
        if held is None:
            return False
        self.offers.pop(held.request_id, None)  # nobody will take it any more
        self.scheduler.free_pages(held.pages, held.replica)
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
            raise transfer.TransferFailed(f"the offer holds {n} tokens; this prompt needs {len(prompt_ids) - 1}")
        if info.get("prompt_digest") != prompt_digest(prompt_ids[:n]):
            raise transfer.TransferFailed("the offered KV belongs to a different prompt (digest mismatch)")
        mine = self.layout.to_json()
        if info.get("layout") != mine:
            raise transfer.TransferFailed(f"KV layout {info.get('layout')} does not match this engine's {mine}")
        if n == 0:
            return [], 0
        specs = [(tuple(s), d) for s, d in info["arrays"]]
        return self.agent.pull(info["transfer_address"], int(info["transfer_id"]), specs), n

    def import_pulled(self, arrays: list, num_tokens: int, replica: int = 0) -> tuple[list[int], int | None]:
        """[lock, stepping thread] Pages of `replica`'s pool (and a hybrid's state slot)
        reserved for the pulled rows (ready arrays), the rows and state written in; returns
        what the scheduler then admits with (page ids local to the replica)."""
        if num_tokens and arrays[0].shape[1] < num_tokens:
            raise transfer.TransferFailed(f"the pulled rows hold {arrays[0].shape[1]} tokens, not {num_tokens}")
        pages, slot = self.scheduler.reserve_prefilled(num_tokens, replica)
        if num_tokens:
            rows = 2 if self.layout.quantized else 1
            values, scales = arrays[0], (arrays[1] if rows == 2 else None)
            try:
                self.runner.import_rows(values, scales, self.global_pages(pages, replica), num_tokens)
                if slot is not None:
                    row = state_row(self.runner.config.engine.state_pool_slots, replica, slot)
                    self.runner.import_state(arrays[rows:rows + 2], row)
            except BaseException:
                self.scheduler.free_pages(pages, replica, state_slot=slot)
                raise
        return pages, slot

    def global_pages(self, pages: list[int], replica: int) -> list[int]:
        """A replica's page ids as ids of the cache's page axis, which holds mesh.data pools
        of pages_per_replica pages each, replica-major (models/kv_cache.py)."""
        return [replica * self.pages_per_replica + p for p in pages]
