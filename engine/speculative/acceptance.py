"""Which proposals a verification step accepts, and the counters Engine.stats() reports.

The step samples one token per verification row with the request's own sampler
(engine/sampler.py): row i draws y_i from the target distribution p_i given the prefix
and proposals x_0..x_{i-1}, with the noise of output index len(output) + i. Acceptance is
then one rule for greedy and sampled rows alike: accept x_i while x_i == y_i, and emit y
at the first mismatch (or the bonus row's token after all k).

Why this is exact rejection sampling for a point-mass draft (the n-gram proposer puts
all its mass on x_i): P(accept x_i) = P(y_i = x_i) = p_i(x_i), and on a reject the emitted
y_i is distributed as p_i conditioned on y_i != x_i, i.e. p_i with x_i removed and
renormalised. So every emitted token follows the target distribution. Since the noise
is a function of (seed, output index, token) alone, a seeded request emits the very
tokens it would have emitted without speculation, and greedy rows trivially so.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence


def accept_prefix(draft: Sequence[int],  # [d] proposed tokens
                  targets: Sequence[int],  # [d + 1] tokens sampled at the verification rows
                  ) -> list[int]:  # [a + 1] emitted: a accepted proposals, then the target's own
    """The tokens a verification emits: the accepted proposals, then the target's token at
    the first mismatch, or the bonus token after all of them. `targets` has one token per
    verification row: len(draft) + 1."""
    if len(targets) != len(draft) + 1:
        raise ValueError(f"{len(draft)} proposals need {len(draft) + 1} sampled rows, got {len(targets)}")
    out = []
    for x, y in zip(draft, targets):
        out.append(int(y))
        if int(x) != int(y):
            return out
    out.append(int(targets[-1]))
    return out


@dataclasses.dataclass
class SpecCounters:
    """Proposed and accepted tokens since start; per_position[i]: verifications whose
    proposal i was accepted (so it never grows as i does)."""

    num_tokens: int
    proposed: int = 0
    accepted: int = 0
    verifications: int = 0
    per_position: list[int] | None = None
    # linear-attention hybrids: verifications whose state went back (a proposal rejected),
    # and the rows computed again (engine/scheduler/verification.py settle)
    replays: int = 0
    replayed_rows: int = 0

    def __post_init__(self):
        if self.per_position is None:
            self.per_position = [0] * self.num_tokens

    @staticmethod
    def total(counters: list["SpecCounters"]) -> "SpecCounters":
        """One data replica's counters each -> their sum."""
        return SpecCounters(counters[0].num_tokens, sum(c.proposed for c in counters),
                            sum(c.accepted for c in counters), sum(c.verifications for c in counters),
                            [sum(col) for col in zip(*(c.per_position for c in counters))],
                            sum(c.replays for c in counters), sum(c.replayed_rows for c in counters))

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.proposed += num_proposed
        self.accepted += num_accepted
        self.verifications += 1
        for i in range(num_accepted):
            self.per_position[i] += 1

    def record_replay(self, rows: int) -> None:
        self.replays += 1
        self.replayed_rows += rows

    def stats(self) -> dict:
        """spec_mean_acceptance_length: tokens emitted per verification (accepted + 1)."""
        mean = (self.accepted + self.verifications) / self.verifications if self.verifications else 0.0
        return {"spec_proposed_tokens": self.proposed, "spec_accepted_tokens": self.accepted,
                "spec_accepted_per_position": list(self.per_position), "spec_mean_acceptance_length": mean,
                "spec_verifications": self.verifications, "spec_state_replays": self.replays,
                "spec_state_replayed_rows": self.replayed_rows}
