"""A step's per-row sampling parameters (SamplingArrays, host numpy) filled from requests.

One row per sampled token: a sequence's last row, and with speculative decoding each row
that verifies a proposal (engine/speculative/verify_rows.py). A verification row samples
as if the proposals before it had already been emitted: its output index and penalty
history count them, so its draw is the one the request would make one token per step.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxfill.engine.request import LOGIT_BIAS_SLOTS
from jaxfill.engine.sampler import SamplingArrays
from jaxfill.engine.structured_output import bitmask_words, fill_bitmask


def empty_sampling(rows: int, penalty_window: int, vocab_size: int) -> SamplingArrays:
    """Padding rows: greedy, no penalties, no bias, unconstrained."""
    return SamplingArrays(
        temperature=np.zeros(rows, np.float32), top_k=np.zeros(rows, np.int32), top_p=np.ones(rows, np.float32),
        min_p=np.zeros(rows, np.float32), seed_hi=np.zeros(rows, np.uint32), seed_lo=np.zeros(rows, np.uint32),
        out_index=np.zeros(rows, np.int32), repetition_penalty=np.ones(rows, np.float32),
        presence_penalty=np.zeros(rows, np.float32), frequency_penalty=np.zeros(rows, np.float32),
        hist=np.full((rows, penalty_window), -1, np.int32), want_logprobs=np.zeros(rows, np.bool_),
        bias_ids=np.full((rows, LOGIT_BIAS_SLOTS), -1, np.int32),
        bias_values=np.zeros((rows, LOGIT_BIAS_SLOTS), np.float32),
        allowed=np.full((rows, bitmask_words(vocab_size)), -1, np.int32))


def split_seed(seed: int) -> tuple[int, int]:
    seed &= (1 << 64) - 1
    return seed >> 32, seed & 0xFFFFFFFF


def fill_sampling(sp: SamplingArrays, i: int, req, vocab_size: int,
                  ahead: Sequence[int] = ()) -> int:
    """Row i samples the request's next token; `ahead`: proposals taken as already emitted
    before it (a verification row). Returns the row's hist_src: the previous step's output
    row its newest history slot comes from (async scheduling), or -1."""
    p = req.params
    sp.temperature[i], sp.top_k[i], sp.top_p[i], sp.min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
    sp.seed_hi[i], sp.seed_lo[i] = split_seed(req.seed)
    sp.out_index[i] = len(req.output_ids) + req.in_flight + len(ahead)
    sp.want_logprobs[i] = p.logprobs is not None
    bias = list(p.logit_bias)
    if sp.out_index[i] < p.min_tokens:
        bias += [(t, -np.inf) for t in (*req.eos_token_ids, *p.stop_token_ids)]
    if req.matcher is not None:
        fill_bitmask(req.matcher, sp.allowed[i])
    if bias:
        sp.bias_ids[i, :len(bias)] = [t for t, _ in bias]
        sp.bias_values[i, :len(bias)] = [b for _, b in bias]
    if p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty:
        return -1
    sp.repetition_penalty[i], sp.presence_penalty[i], sp.frequency_penalty[i] = (
        p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
    window = sp.hist.shape[1]
    pend = 1 if req.in_flight else 0  # slot 0 takes the in-flight token on the device
    keep = window - pend
    emitted = list(req.output_ids) + list(ahead)
    outs = emitted[max(0, len(emitted) - keep):]
    room = keep - len(outs)
    prompt = req.prompt_ids[-room:] if room > 0 else []
    h = np.asarray(list(outs) + [x + vocab_size for x in prompt], np.int32)
    sp.hist[i, pend:pend + len(h)] = h
    return req.pending_row if pend else -1
