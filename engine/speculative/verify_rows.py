"""The rows of a step that verify proposals, beside the one sampled row per sequence.

A decode with proposals x_0..x_{d-1} runs as a chunk of 1 + d rows: its last known token,
then the proposals. The chunk's last row stays the sequence's sampled row (the bonus
token, after every proposal); rows 0..d-1 of the chunk predict x_0..x_{d-1} and are
sampled here too, each with the request's own sampler as if the proposals before it had
been emitted (engine/sampling_rows.py). A step without proposals carries no VerifyRows,
so its program is the one the engine compiles without speculative decoding.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxfill.engine.sampler import SamplingArrays
from jaxfill.engine.sampling_rows import empty_sampling, fill_sampling


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyRows:
    rows: jax.Array  # [Q] i32: token rows whose logits are sampled (padding: 0, sampled and ignored)
    sampling: SamplingArrays  # [Q] rows


class VerifyRowsBuilder:
    """Fills up to `size` verification rows (one static size per engine, so one program
    per bucket); row q of the step's output is row S + q (engine/step.py)."""

    def __init__(self, size: int, penalty_window: int, vocab_size: int):
        self.size = size
        self.vocab_size = vocab_size
        self.rows = np.zeros(size, np.int32)
        self.sampling = empty_sampling(size, penalty_window, vocab_size)
        self.used = 0

    def add(self, sch, first_row: int) -> int:
        """The sequence's chunk starts at token row `first_row`; returns its first
        verification row (the others follow it)."""
        draft = sch.draft
        q0 = self.used
        if q0 + len(draft) > self.size:
            raise ValueError(f"{q0 + len(draft)} verification rows in one step, over {self.size} "
                             "(engine.max_num_seqs x speculative.num_tokens)")
        for j in range(len(draft)):
            self.rows[q0 + j] = first_row + j
            fill_sampling(self.sampling, q0 + j, sch.req, self.vocab_size, draft[:j])
        self.used += len(draft)
        return q0

    def build(self) -> VerifyRows | None:
        return VerifyRows(self.rows, self.sampling) if self.used else None


def padding_rows(size: int, penalty_window: int, vocab_size: int) -> VerifyRows:
    """`size` padding verification rows (warm-up compiles the program with them)."""
    return VerifyRows(np.zeros(size, np.int32), empty_sampling(size, penalty_window, vocab_size))
