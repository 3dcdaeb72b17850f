"""What the MTP proposer's half of a step needs beside the target's batch (engine/speculative/mtp_step.py).

The MTP layer runs over every row of the step, each row t with the target's hidden state
h_t and the token after it, x_{t+1}, writing its own K/V into t's slot: so every position
whose target K/V the step writes gets its MTP K/V too (prompt chunks, decodes, verified
proposals), and later rows attend over all of them. The token after a row is known on the
host for all but the rows that sample: a chunk's last row when it reaches the newest token
(its sampled token, output row i) and a verification row q (its sampled token, output row
S + q, which equals the proposal where that was accepted). Rows past the last accepted one
get a rejected token; their K/V is overwritten when the sequence computes those positions
again, as the target's is.

The proposal for sequence i comes from its last accepted row: the chunk's last row minus
its rejected proposals, counted on the device (the step's samples are never waited for).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MTPRows:
    next_tokens: jax.Array  # [T] i32: the token after each row where the host knows it
    next_src: jax.Array  # [T] i32: else the output row (S + Q rows) whose sampled token it is; -1 = host's
    verify_seq: jax.Array  # [Q] i32: the sequence of verification row q (S for padding)
    verify_index: jax.Array  # [Q] i32: q's place among its sequence's proposals (0, 1, ...)
    num_draft: jax.Array  # [S] i32: proposals each sequence verifies this step


class MTPRowsBuilder:
    def __init__(self, t_pad: int, s_pad: int, verify_rows: int):
        self.next_tokens = np.zeros(t_pad, np.int32)
        self.next_src = np.full(t_pad, -1, np.int32)
        self.verify_seq = np.full(verify_rows, s_pad, np.int32)
        self.verify_index = np.zeros(verify_rows, np.int32)
        self.num_draft = np.zeros(s_pad, np.int32)
        self.s_pad = s_pad

    def add(self, i: int, sch, first_row: int, q0: int, known_after: list[int]) -> None:
        """Sequence i's chunk at rows first_row..; its verification rows start at output
        row S + q0; `known_after`: the known tokens after its known rows (prompt or output
        tokens past the chunk: none when it reaches the newest token)."""
        n, d = sch.num_new, len(sch.draft)
        known = n - d  # rows of known tokens, then the proposals
        rows = np.arange(first_row, first_row + n)
        # a known row's next token is the next row's input, or the first known token after the chunk
        if known > 1:
            self.next_src[rows[:known - 1]] = -2  # filled from the step's own tokens (mtp_step.py)
        last = first_row + known - 1
        if d:
            for j in range(d):  # known last row, then proposals 0..d-2: each the sampled token of its row
                self.next_src[last + j] = self.s_pad + q0 + j
                self.verify_seq[q0 + j] = i
                self.verify_index[q0 + j] = j
            self.next_src[last + d] = i  # the bonus row
            self.num_draft[i] = d
        elif known_after:
            self.next_tokens[last] = known_after[0]
        else:
            self.next_src[last] = i

    def build(self) -> MTPRows:
        return MTPRows(self.next_tokens, self.next_src, self.verify_seq, self.verify_index, self.num_draft)


def padding_mtp_rows(t_pad: int, s_pad: int, verify_rows: int) -> MTPRows:
    return MTPRowsBuilder(t_pad, s_pad, verify_rows).build()
