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

from jaxfill.engine.pooling.rows import fill_pool_seg
from jaxfill.engine.sampler import SamplingArrays
from jaxfill.engine.sampling_rows import empty_sampling, fill_sampling
from jaxfill.engine.scheduler import SchedulerOutput
from jaxfill.engine.speculative.mtp_rows import MTPRows, MTPRowsBuilder
from jaxfill.engine.speculative.verify_rows import VerifyRows, VerifyRowsBuilder
from jaxfill.models.kv_cache import AttentionMetadata
from jaxfill.models.vision.rows import VisionRows


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
    verify: VerifyRows | None = None  # rows verifying proposals (engine/speculative/verify_rows.py)
    pool_seg: jax.Array | None = None  # [T] i32: the sequence row each token pools into, S = none (engine/pooling/)
    mtp: MTPRows | None = None  # the MTP proposer's rows (engine/speculative/mtp_rows.py), in every step of it
    vision: VisionRows | None = None  # multimodal rope positions and image rows (engine/vision/tower.py)

    @property
    def shape(self) -> tuple[int, int]:
        return self.tokens.shape[0], self.meta.kv_lens.shape[0]


def token_buckets(settings) -> tuple[int, ...]:
    """Explicit engine.token_buckets, or engine.decode_buckets then 16, 64, 256, ... (x4),
    plus the token budget."""
    budget = settings.max_num_batched_tokens
    if settings.token_buckets:
        b = tuple(sorted(set(int(x) for x in settings.token_buckets)))
        return tuple(x for x in b if x < budget) + (budget,)
    out, b = {int(x) for x in settings.decode_buckets if int(x) < budget}, min(16, budget)
    while b < budget:
        out.add(b)
        b *= 4
    return tuple(sorted(out)) + (budget,)


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


def build_batch(out: SchedulerOutput, shape: tuple[int, int], page_size: int, max_pages: int,
                vocab_size: int, penalty_window: int, prompt_rows: int = 1, state_slots: bool = False,
                verify_rows: int = 0, pool: bool = False, lora: bool = False, mtp: bool = False) -> StepBatch:
    """`state_slots`: the batch names each sequence's recurrent-state slot (linear-attention hybrids).
    `verify_rows`: the static number of rows verifying proposals, when any sequence has some.
    `pool`: the pooling variant even with no pooling request (a model without an LM head
    runs no other); it is chosen anyway when a sequence pools. `lora`: the rows carry their
    requests' adapter slots (meta.lora_slots; engine/lora/), 0 for padding and base rows.
    `mtp`: the MTP proposer's rows (speculative.method = "mtp"), in every batch of that engine."""
    t_pad, s_pad = shape
    tokens = np.zeros(t_pad, np.int32)
    positions = np.zeros(t_pad, np.int32)
    slots = np.full(t_pad, -1, np.int32)
    cu = np.zeros(s_pad + 1, np.int32)
    kv_lens = np.zeros(s_pad, np.int32)
    page_indices = np.zeros((s_pad, max_pages), np.int32)
    logits_idx = np.zeros(s_pad, np.int32)
    seq_slots = np.zeros(s_pad, np.int32) if state_slots else None
    lora_slots = np.zeros(t_pad, np.int32) if lora else None
    sampling = empty_sampling(s_pad, penalty_window, vocab_size)
    prev_src = np.full(t_pad, -1, np.int32)
    hist_src = np.full(s_pad, -1, np.int32)
    lp_rows = np.full(prompt_rows, -1, np.int32)
    lp_targets = np.full(prompt_rows, -1, np.int32)
    num_lp = 0
    verify = VerifyRowsBuilder(verify_rows, penalty_window, vocab_size)
    mtp_rows = MTPRowsBuilder(t_pad, s_pad, verify_rows) if mtp else None
    pooling = pool or any(sch.req.pooling is not None for sch in out.seqs)
    pool_seg = np.full(t_pad, s_pad, np.int32) if pooling else None  # the pooling variant (engine/pooling/)

    pos_t = 0
    for i, sch in enumerate(out.seqs):
        req, start, n = sch.req, sch.start, sch.num_new
        end = start + n
        known = end - len(sch.draft)  # proposals (speculative decoding) follow the known tokens
        npr = len(req.prompt_ids)
        sl = slice(pos_t, pos_t + n - len(sch.draft))
        if known > req.num_tokens:  # its input is the token still in flight
            if n != 1 or start != req.num_tokens or req.pending_row < 0:
                raise ValueError(f"{req.request_id}: only a one-token decode may take an in-flight token "
                                 f"(start {start}, {n} tokens, {req.num_tokens} known)")
            prev_src[pos_t] = req.pending_row
        elif start >= npr:
            tokens[sl] = req.output_ids[start - npr:known - npr]
        else:
            tokens[sl] = req.prompt_ids[start:known] + (req.output_ids[:known - npr] if known > npr else [])
        q0 = 0
        if sch.draft:
            tokens[pos_t + n - len(sch.draft):pos_t + n] = sch.draft
            q0 = verify.add(sch, pos_t)
        if mtp_rows is not None:
            mtp_rows.add(i, sch, pos_t, q0, known_tokens(req, known, known + 1))
        sl = slice(pos_t, pos_t + n)
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
        if req.pooling is not None:
            fill_pool_seg(pool_seg, i, pos_t - n, start, n, req)
        if state_slots:
            seq_slots[i] = req.state_slot
        if lora:
            lora_slots[sl] = req.lora_slot
        if sch.samples:
            hist_src[i] = fill_sampling(sampling, i, req, vocab_size, sch.draft)
    num = len(out.seqs)
    cu[num + 1:] = pos_t
    meta = AttentionMetadata(cu_q_lens=cu, kv_lens=kv_lens, page_indices=page_indices,
                             num_seqs=np.asarray([num], np.int32), slot_mapping=slots,
                             logits_indices=logits_idx, state_slots=seq_slots, lora_slots=lora_slots)
    return StepBatch(tokens, positions, meta, sampling, prev_src, hist_src, lp_rows, lp_targets, verify.build(),
                     pool_seg, None if mtp_rows is None else mtp_rows.build())


def known_tokens(req, start: int, stop: int) -> list[int]:
    """The request's known tokens at positions [start, stop) (prompt, then output; fewer
    where they end)."""
    npr = len(req.prompt_ids)
    return (list(req.prompt_ids[start:stop]) + list(req.output_ids[max(0, start - npr):max(0, stop - npr)]))[
        :max(0, stop - start)]


def dummy_batch(shape: tuple[int, int], max_pages: int, penalty_window: int, vocab_size: int,
                prompt_rows: int = 1, state_slots: bool = False, pool: bool = False, lora: bool = False,
                verify_rows: int = 0, mtp: bool = False) -> StepBatch:
    """An all-padding batch of one bucket shape (warm-up): one live 1-token sequence on
    the null page whose write is skipped (slot -1)."""
    t_pad, s_pad = shape
    from jaxfill.engine.scheduler import SchedulerOutput

    b = build_batch(SchedulerOutput([], [], []), shape, 1, max_pages, vocab_size, penalty_window, prompt_rows,
                    state_slots, verify_rows=verify_rows, pool=pool, lora=lora, mtp=mtp)
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
