"""What Scheduler.schedule() hands the engine for one step: per data replica, the rows to
run (`Scheduled`: a request's chunk, the host-tier pages to write back first, the state
snapshot to resume from), the requests it preempted or finished, and the linear-attention
state copies to run before the step. batch.py turns it into arrays; transitions.py reads
it back when the step's results arrive.
"""

from __future__ import annotations

import dataclasses

from jaxfill.engine.request import Request


@dataclasses.dataclass
class Restore:
    """A prefix page kept in the host tier, to be written into a fresh device page."""

    hash: bytes
    tier: str  # "host" or "disk": where the lookup found it
    page: int = -1  # the device page it goes to (set at admission)


@dataclasses.dataclass
class Scheduled:
    req: Request
    start: int  # num_computed when scheduled: first new token's position
    num_new: int
    restores: list[Restore] = dataclasses.field(default_factory=list)  # pages to write before the step
    state_from: int | None = None  # a snapshot slot to copy into the request's state slot first (hybrids)
    state_host: bytes | None = None  # or the hash of a snapshot in the host tier to write there
    # proposals (speculative decoding) run after the known tokens: the chunk's last num_new - len(draft)
    # rows are known tokens, the rest proposed (engine/speculative/)
    draft: list[int] = dataclasses.field(default_factory=list)
    samples: bool = dataclasses.field(init=False)  # the chunk reaches the end: a token is drawn

    def __post_init__(self):
        # Fixed when scheduled: with async scheduling the request's counts move on before
        # this step's results come back.
        self.samples = self.start + self.num_new - len(self.draft) == total_tokens(self.req)


def total_tokens(req: Request) -> int:
    """Tokens the request holds, counting those sampled on the device but not yet known here."""
    return req.num_tokens + req.in_flight


def to_compute(req: Request) -> int:
    return total_tokens(req) - req.num_computed


@dataclasses.dataclass
class SchedulerOutput:
    seqs: list[Scheduled]
    preempted: list[Request]
    finished: list[Request]  # finished here with "length": no room even alone
    # (working slot, snapshot slot) copies to run before the step (state_snapshots.py)
    state_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # (snapshot slot, hash): snapshots those copies push out, to save to the host tier first
    state_saves: list[tuple[int, bytes]] = dataclasses.field(default_factory=list)
    # (request id, working slot): a held prefill's state at its last prompt row but one, to
    # export after the copies, before the step (engine/disagg/handoff.py)
    state_exports: list[tuple[str, int]] = dataclasses.field(default_factory=list)

    @property
    def state_restores(self) -> list[tuple[int, int]]:
        """(snapshot slot, working slot) copies to run after state_copies, before the step."""
        return [(s.state_from, s.req.state_slot) for s in self.seqs if s.state_from is not None]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.seqs)
