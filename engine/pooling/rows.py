"""Which rows of a scheduled chunk a pooling request adds into its vector.

One program serves every mode: the host marks rows in the batch's `pool_seg` (the
sequence's row in the step, or S for none) and the step sums the marked rows' final-norm
hidden states per sequence (models/decoder.py pool_rows).
"""

from __future__ import annotations

import numpy as np


def pooled_positions(mode: str, start: int, num_new: int, prompt_len: int) -> range:
    """Prompt positions in the chunk [start, start + num_new) that `mode` pools:
    last: the prompt's last token; cls: its first; mean: every prompt token."""
    end = min(start + num_new, prompt_len)
    if mode == "mean":
        return range(start, max(start, end))
    at = prompt_len - 1 if mode == "last" else 0
    return range(at, at + 1) if start <= at < end else range(0)


def fill_pool_seg(pool_seg: np.ndarray,  # [T] i32, S = none
                  seq: int, first_row: int, start: int, num_new: int, req) -> None:
    """Marks sequence `seq`'s pooled rows; its chunk starts at token row `first_row`."""
    rows = pooled_positions(req.pooling.mode, start, num_new, len(req.prompt_ids))
    if len(rows):
        pool_seg[first_row + rows.start - start:first_row + rows.stop - start] = seq
