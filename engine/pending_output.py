"""A dispatched step's sampled rows: on the device until the scheduler needs them on the host."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


@dataclasses.dataclass
class HostOutput:
    tokens: np.ndarray  # [R * S] i32, replica-major
    logprob: np.ndarray  # [R * S] f32
    top_ids: np.ndarray  # [R * S, N]
    top_logprobs: np.ndarray  # [R * S, N]
    prompt: tuple | None = None  # a step that scored prompt rows: ([R * P] f32, [R * P, N] i32, [R * P, N] f32)
    pooled: np.ndarray | None = None  # a pooling step: [S, E] f32 per-sequence sums (engine/pooling/)
    mtp: np.ndarray | None = None  # the MTP proposer's step: [S] i32 proposals (engine/speculative/mtp_step.py)


class PendingOutput:
    """A dispatched step's sampled rows, still on the device (jax dispatch is asynchronous):
    `get()` waits for them. Async scheduling dispatches the next step before calling it."""

    def __init__(self, out):
        self._out = out
        self._host: HostOutput | None = None

    def get(self) -> HostOutput:
        if self._host is None:
            o = self._out
            tokens, lp, ids, lps, prompt, pooled, mtp = jax.device_get((o.tokens, o.logprob, o.top_ids,
                                                                        o.top_logprobs, o.prompt, o.pooled, o.mtp))
            self._host = HostOutput(np.asarray(tokens), np.asarray(lp), np.asarray(ids), np.asarray(lps),
                                    None if prompt is None else tuple(np.asarray(x) for x in prompt),
                                    None if pooled is None else np.asarray(pooled),
                                    None if mtp is None else np.asarray(mtp))
            self._out = None
        return self._host
