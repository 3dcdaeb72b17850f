"""A pooling request's vector, gathered on the host from its chunks' sums.

Chunked prefill computes a prompt over several steps; each step returns the sum of the
chunk's pooled rows. A preemption or an interrupt recomputes from an earlier position, so a
part that starts at or after a new part's start is dropped: the parts kept always tile the
prompt once (after a cached prefix, for last-token pooling), and `vector` checks that they do.
"""

from __future__ import annotations

import numpy as np

from jaxfill.engine.pooling.rows import pooled_positions


def add_part(req, start: int, num_new: int,
             pooled: np.ndarray) -> None:  # [E] f32: the chunk's sum of its pooled rows
    end = min(start + num_new, len(req.prompt_ids))
    req.pool_parts = [p for p in req.pool_parts if p[0] < start] + [(start, end, np.asarray(pooled, np.float64))]


def vector(req) -> np.ndarray:  # -> [E] f32
    """The pooled vector: the sum over the parts (divided by the prompt length for mean),
    L2-normalized when the request asks."""
    parts, n = req.pool_parts, len(req.prompt_ids)
    covered = [(s, e) for s, e, _ in parts]
    first = 0 if req.pooling.every_row else covered[0][0]  # last-token pooling may start after a cached prefix
    if covered[0][0] != first or covered[-1][1] != n or any(a[1] != b[0] for a, b in zip(covered, covered[1:])):
        raise RuntimeError(f"{req.request_id}: pooled chunks {covered} do not cover the prompt [0, {n})")
    total = np.sum([p for _, _, p in parts], axis=0)
    if req.pooling.mode == "mean":
        total = total / len(pooled_positions("mean", 0, n, n))
    if req.pooling.normalize:
        total = total / max(np.linalg.norm(total), 1e-12)  # sentence-transformers' F.normalize eps
    return total.astype(np.float32)
