"""Scheduler output -> host numpy arrays padded to one of a few fixed (tokens, seqs) buckets.

Padding tokens get slot -1 (write nothing) and position 0; padding sequences get
kv_len 0, an empty q range (cu_q_lens repeats the total) and page 0 everywhere.

Async scheduling: a decode whose input token was sampled by the step still in flight
gets a placeholder token and, in `prev_src`, that token's row in the previous step's
output; the jitted step takes it from there on the device (engine/step.py). `hist_src`
does the same for the newest slot of the penalty history.
"""

from __future__ import annotations

import bisect
import dataclasses

import jax
import numpy as np

from jaxfill.engine.request import LOGIT_BIAS_SLOTS
from jaxfill.engine.sampler import SamplingArrays
from jaxfill.engine.structured_output import bitmask_words, fill_bitmask
from jaxfill.engine.scheduler import SchedulerOutput
from jaxfill.models.kv_cache import AttentionMetadata


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    tokens: jax.Array  # [T] i32
    positions: jax.Array  # [T] i32
    meta: AttentionMetadata
    sampling: SamplingArrays
    prev_src: jax.Array  # [T] i32: row of the previous step's tokens to take this token from, or -1
    hist_src: jax.Array  # [S] i32: the same for hist[:, 0], or -1
    lp_rows: jax.Array  # [P] i32: token rows scored for prompt_logprobs, -1 = none (engine/step.py)
    lp_targets: jax.Array  # [P] i32: the prompt token each of those rows predicts

    @property
    def shape(self) -> tuple[int, int]:
        return self.tokens.shape[0], self.meta.kv_lens.shape[0]


def token_buckets(settings) -> tuple[int, ...]:
    """Explicit engine.token_buckets, or 16, 64, 256, ... (x4) plus the token budget."""
    budget = settings.max_num_batched_tokens
    if settings.token_buckets:
        b = tuple(sorted(set(int(x) for x in settings.token_buckets)))
        return tuple(x for x in b if x < budget) + (budget,)
    out, b = [], min(16, budget)
    while b < budget:
        out.append(b)
        b *= 4
    return tuple(out) + (budget,)


def seq_buckets(settings) -> tuple[int, ...]:
    """Explicit engine.seq_buckets, or just max_num_seqs (padding rows are cheap)."""
    m = settings.max_num_seqs
    if settings.seq_buckets:
        b = sorted(set(int(x) for x in settings.seq_buckets))
        return tuple(x for x in b if x < m) + (m,)
    return (m,)


def bucket_shapes(settings, multiple_of: int = 1) -> list[tuple[int, int]]:
    """Every (T, S) a step can take; S <= T since each sequence brings at least one token.
    `multiple_of`: mesh.sequence, which splits a step's rows evenly (T rounded up to it)."""
    shapes = []
    for t in sorted({-(-t // multiple_of) * multiple_of for t in token_buckets(settings)}):
        for s in sorted({min(s, t) for s in seq_buckets(settings)}):
            shapes.append((t, s))
    return shapes


def describe_buckets(shapes: list[tuple[int, int]]) -> str:
    """For logs: '3 step buckets (tokens x seqs): 16x16, 64x16, 256x16'."""
    return f"{len(shapes)} step buckets (tokens x seqs): " + ", ".join(f"{t}x{s}" for t, s in shapes)


def pick_bucket(shapes: list[tuple[int, int]], num_tokens: int, num_seqs: int) -> tuple[int, int]:
    i = bisect.bisect_left(shapes, (num_tokens, 0))
    for t, s in shapes[i:]:
        if t >= num_tokens and s >= num_seqs:
            return t, s
    raise ValueError(f"no bucket holds {num_tokens} tokens / {num_seqs} seqs; buckets: {shapes}")


def prompt_logprob_positions(sch) -> range:
    """Positions p of a scheduled chunk whose row is scored for prompt_logprobs: the row of
    p predicts prompt token p + 1, so the prompt's last position is not among them."""
    req = sch.req
    if req.params.prompt_logprobs is None:
        return range(0)
    return range(sch.start, max(sch.start, min(sch.start + sch.num_new, len(req.prompt_ids) - 1)))


def _split_seed(seed: int) -> tuple[int, int]:
    seed &= (1 << 64) - 1
    return seed >> 32, seed & 0xFFFFFFFF


def build_batch(out: SchedulerOutput, shape: tuple[int, int], page_size: int, max_pages: int,
                vocab_size: int, penalty_window: int, prompt_rows: int = 1, state_slots: bool = False) -> StepBatch:
    """`state_slots`: the batch names each sequence's recurrent-state slot (linear-attention hybrids)."""
    t_pad, s_pad = shape
    tokens = np.zeros(t_pad, np.int32)
    positions = np.zeros(t_pad, np.int32)
    slots = np.full(t_pad, -1, np.int32)
    cu = np.zeros(s_pad + 1, np.int32)
    kv_lens = np.zeros(s_pad, np.int32)
    page_indices = np.zeros((s_pad, max_pages), np.int32)
    logits_idx = np.zeros(s_pad, np.int32)
    seq_slots = np.zeros(s_pad, np.int32) if state_slots else None
    temp = np.zeros(s_pad, np.float32)
    top_k = np.zeros(s_pad, np.int32)
    top_p = np.ones(s_pad, np.float32)
    min_p = np.zeros(s_pad, np.float32)
    seed_hi = np.zeros(s_pad, np.uint32)
    seed_lo = np.zeros(s_pad, np.uint32)
    out_index = np.zeros(s_pad, np.int32)
    rep = np.ones(s_pad, np.float32)
    pres = np.zeros(s_pad, np.float32)
    freq = np.zeros(s_pad, np.float32)
    hist = np.full((s_pad, penalty_window), -1, np.int32)
    want_lp = np.zeros(s_pad, np.bool_)
    bias_ids = np.full((s_pad, LOGIT_BIAS_SLOTS), -1, np.int32)
    bias_values = np.zeros((s_pad, LOGIT_BIAS_SLOTS), np.float32)
    allowed = np.full((s_pad, bitmask_words(vocab_size)), -1, np.int32)
    prev_src = np.full(t_pad, -1, np.int32)
    hist_src = np.full(s_pad, -1, np.int32)
    lp_rows = np.full(prompt_rows, -1, np.int32)
    lp_targets = np.full(prompt_rows, -1, np.int32)
    num_lp = 0

    pos_t = 0
    for i, sch in enumerate(out.seqs):
        req, start, n = sch.req, sch.start, sch.num_new
        end = start + n
        npr = len(req.prompt_ids)
        sl = slice(pos_t, pos_t + n)
        if end > req.num_tokens:  # its input is the token still in flight
            if n != 1 or start != req.num_tokens or req.pending_row < 0:
                raise ValueError(f"{req.request_id}: only a one-token decode may take an in-flight token "
                                 f"(start {start}, {n} tokens, {req.num_tokens} known)")
            prev_src[pos_t] = req.pending_row
        elif start >= npr:
            tokens[sl] = req.output_ids[start - npr:end - npr]
        else:
            tokens[sl] = req.prompt_ids[start:end] + (req.output_ids[:end - npr] if end > npr else [])
        pos = np.arange(start, end, dtype=np.int32)
        positions[sl] = pos
        scored = prompt_logprob_positions(sch)
        if len(scored):
            if num_lp + len(scored) > prompt_rows:
                raise ValueError(f"{req.request_id}: {num_lp + len(scored)} prompt_logprobs rows in one step, "
                                 f"over engine.prompt_logprobs_rows ({prompt_rows})")
            lp_rows[num_lp:num_lp + len(scored)] = pos_t + np.arange(len(scored)) + (scored.start - start)
            lp_targets[num_lp:num_lp + len(scored)] = req.prompt_ids[scored.start + 1:scored.stop + 1]
            num_lp += len(scored)
        pages = np.asarray(req.pages, np.int32)
        slots[sl] = pages[pos // page_size] * page_size + pos % page_size
        pos_t += n
        cu[i + 1] = pos_t
        kv_lens[i] = end
        page_indices[i, :len(pages)] = pages
        logits_idx[i] = pos_t - 1
        if state_slots:
            seq_slots[i] = req.state_slot
        if sch.samples:
            p = req.params
            temp[i], top_k[i], top_p[i], min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
            seed_hi[i], seed_lo[i] = _split_seed(req.seed)
            out_index[i] = len(req.output_ids) + req.in_flight
            want_lp[i] = p.logprobs is not None
            bias = list(p.logit_bias)
            if out_index[i] < p.min_tokens:
                bias += [(t, -np.inf) for t in (*req.eos_token_ids, *p.stop_token_ids)]
            if req.matcher is not None:
                fill_bitmask(req.matcher, allowed[i])
            if bias:
                bias_ids[i, :len(bias)] = [t for t, _ in bias]
                bias_values[i, :len(bias)] = [b for _, b in bias]
            if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
                rep[i], pres[i], freq[i] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
                pend = 1 if req.in_flight else 0  # slot 0 takes the in-flight token on the device
                keep = penalty_window - pend
                outs = req.output_ids[max(0, len(req.output_ids) - keep):]
                room = keep - len(outs)
                prompt = req.prompt_ids[-room:] if room > 0 else []
                h = np.asarray(list(outs) + [x + vocab_size for x in prompt], np.int32)
                hist[i, pend:pend + len(h)] = h
                if pend:
                    hist_src[i] = req.pending_row
    num = len(out.seqs)
    cu[num + 1:] = pos_t
    meta = AttentionMetadata(cu_q_lens=cu, kv_lens=kv_lens, page_indices=page_indices,
                             num_seqs=np.asarray([num], np.int32), slot_mapping=slots,
                             logits_indices=logits_idx, state_slots=seq_slots)
    sampling = SamplingArrays(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                              seed_hi=seed_hi, seed_lo=seed_lo, out_index=out_index,
                              repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq,
                              hist=hist, want_logprobs=want_lp, bias_ids=bias_ids, bias_values=bias_values,
                              allowed=allowed)
    return StepBatch(tokens, positions, meta, sampling, prev_src, hist_src, lp_rows, lp_targets)


def dummy_batch(shape: tuple[int, int], max_pages: int, penalty_window: int, vocab_size: int,
                prompt_rows: int = 1, state_slots: bool = False) -> StepBatch:
    """An all-padding batch of one bucket shape (warm-up): one live 1-token sequence on
    the null page whose write is skipped (slot -1)."""
    t_pad, s_pad = shape
    from jaxfill.engine.scheduler import SchedulerOutput

    b = build_batch(SchedulerOutput([], [], []), shape, 1, max_pages, vocab_size, penalty_window, prompt_rows,
                    state_slots)
    b.meta.cu_q_lens[1:] = 1
    b.meta.kv_lens[0] = 1
    b.meta.num_seqs[0] = 1
    return b


def stack_batches(batches: list[StepBatch]) -> StepBatch:
    """One batch per data replica, all of one bucket shape -> leaves stacked [R, ...].
    A single replica's batch is returned as is (the one-replica step takes it unstacked)."""
    if len(batches) == 1:
        return batches[0]
    return jax.tree.map(lambda *xs: np.stack(xs), *batches)
