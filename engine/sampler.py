"""Sampling on device from per-row parameter arrays (pure jnp, runs inside the step jit).

Every sampling knob is data, never a static argument, so changing one never recompiles.

What holds: a row's output (token, logprobs) is a function of its own logits row,
parameters, seed and output index only; bit for bit, whatever the batch size, the row's
slot and what other rows ask for. Noise is a hash of (seed, output index, token id)
(`gumbel_noise`); each `lax.cond` that batch-wide flags select has a branch that is
the identity for a row whose own knob is off, and a row without top-k/top-p/min-p keeps
every token (tests/test_sampling_batch_invariance.py, on XLA:CPU).
What does not: the logits themselves. The engine's f32 logits for a request differ
between batches and token buckets in the last bits (up to ~1e-6 in logprob measured on
tiny_random, XLA:CPU), so a near-tie can in principle flip a token; in the tested
runs (f32, greedy and seeded, alone / crowded / another budget) no token changed. bf16,
sharded meshes, GPU and TPU are untested.

Penalties need each row's token counts. The batch carries a fixed-shape history
`hist[S, H]` of the row's most recent token ids (output tokens as id, prompt tokens as
id + V, padding -1); counts are rebuilt here with one scatter-add. H is
`engine.penalty_window` (static), so penalties see at most the last H tokens.

A structured-output row's grammar mask (`allowed`) comes last, after penalties and bias.

Logprobs are those of the raw model distribution (before penalties, logit_bias, the
grammar mask and temperature):
the chosen token's and the top MAX_LOGPROBS (the host keeps the N each request asked for).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxfill.engine.request import MAX_LOGPROBS_PER_TOKEN

MAX_LOGPROBS = MAX_LOGPROBS_PER_TOKEN  # top-N logprobs per row (the request layer validates against it)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    temperature: jax.Array  # [S] f32, 0 = greedy
    top_k: jax.Array  # [S] i32, 0 = off
    top_p: jax.Array  # [S] f32, 1 = off
    min_p: jax.Array  # [S] f32, 0 = off
    seed_hi: jax.Array  # [S] u32
    seed_lo: jax.Array  # [S] u32
    out_index: jax.Array  # [S] i32, index of the token being sampled in the output
    repetition_penalty: jax.Array  # [S] f32, 1 = off
    presence_penalty: jax.Array  # [S] f32
    frequency_penalty: jax.Array  # [S] f32
    hist: jax.Array  # [S, H] i32: output id | prompt id + V | -1
    want_logprobs: jax.Array  # [S] bool
    bias_ids: jax.Array  # [S, B] i32: logit_bias and min_tokens' masked ids, -1 = none
    bias_values: jax.Array  # [S, B] f32: added to those logits (-inf masks)
    allowed: jax.Array  # [S, W] i32 packed bits (token t: word t // 32, bit t % 32); all ones = unconstrained


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleOutput:
    tokens: jax.Array  # [S] i32
    logprob: jax.Array  # [S] f32, raw logprob of the chosen token
    top_ids: jax.Array  # [S, N] i32
    top_logprobs: jax.Array  # [S, N] f32
    # a step that scores prompt rows (engine/step.py): (logprob [P], top ids [P, N], top logprobs [P, N])
    prompt: tuple | None = None
    pooled: jax.Array | None = None  # a step with pooling rows (engine/pooling/): [S, E] f32 per-sequence sums
    mtp: jax.Array | None = None  # the MTP proposer's step (engine/speculative/mtp_step.py): [S] i32 proposals


def apply_penalties(logits: jax.Array,  # [S, V] f32
                    sp: SamplingArrays) -> jax.Array:
    s, v = logits.shape

    def penalize(logits):
        h = sp.hist
        valid = h >= 0
        is_out = valid & (h < v)
        tok = jnp.where(valid, h % v, 0)
        rows = jnp.broadcast_to(jnp.arange(s)[:, None], h.shape)
        out_counts = jnp.zeros((s, v), jnp.int32).at[rows, tok].add(is_out.astype(jnp.int32))
        seen = jnp.zeros((s, v), jnp.bool_).at[rows, tok].max(valid)
        rp = sp.repetition_penalty[:, None]
        logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
        logits = logits - sp.frequency_penalty[:, None] * out_counts
        logits = logits - sp.presence_penalty[:, None] * (out_counts > 0)
        return logits

    active = jnp.any((sp.repetition_penalty != 1.0) | (sp.presence_penalty != 0.0)
                     | (sp.frequency_penalty != 0.0))
    return jax.lax.cond(active, penalize, lambda x: x, logits)


def apply_bias(logits: jax.Array,  # [S, V] f32
               sp: SamplingArrays) -> jax.Array:
    """logit_bias, and -inf on EOS / stop ids while a row is short of min_tokens; the
    identity (one batch-wide check) when no row has any."""
    def add(logits):
        rows = jnp.broadcast_to(jnp.arange(logits.shape[0])[:, None], sp.bias_ids.shape)
        used = sp.bias_ids >= 0
        return logits.at[rows, jnp.where(used, sp.bias_ids, 0)].add(jnp.where(used, sp.bias_values, 0.0))

    return jax.lax.cond(jnp.any(sp.bias_ids >= 0), add, lambda x: x, logits)


def apply_allowed(logits: jax.Array,  # [S, V] f32, after penalties and bias
                  unbiased: jax.Array,  # [S, V] f32, before them
                  sp: SamplingArrays) -> jax.Array:
    """-inf on the tokens a row's grammar forbids (structured output). Should bias leave a
    row nothing (min_tokens masking the EOS its grammar needs), the grammar wins over the
    bias for that row. The identity (one batch-wide check) when no row is constrained."""
    def mask(logits):
        v = logits.shape[-1]
        bits = (sp.allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]
        ok = bits.reshape(bits.shape[0], -1)[:, :v] > 0
        masked = jnp.where(ok, logits, -jnp.inf)
        stuck = ~jnp.any(jnp.isfinite(masked), axis=-1, keepdims=True)
        return jnp.where(stuck, jnp.where(ok, unbiased, -jnp.inf), masked)

    return jax.lax.cond(jnp.any(sp.allowed != -1), mask, lambda x: x, logits)


def filter_mask(scaled: jax.Array,  # [S, V] f32, logits / temperature
                sp: SamplingArrays) -> jax.Array:  # [S, V] bool: tokens that may be drawn
    """top-k, then top-p on the renormalised top-k distribution, and min-p (vs the max)."""
    s, v = scaled.shape

    def cutoff(scaled):
        vals = jax.lax.top_k(scaled, v)[0]  # [S, V] descending
        pos = jnp.arange(v)[None, :]
        k = jnp.where(sp.top_k <= 0, v, jnp.minimum(sp.top_k, v))[:, None]
        in_k = pos < k
        probs = jax.nn.softmax(jnp.where(in_k, vals, -jnp.inf), axis=-1)
        cum = jnp.cumsum(probs, axis=-1)
        keep = in_k & ((cum - probs) < sp.top_p[:, None])
        keep &= probs >= sp.min_p[:, None] * probs[:, :1]
        n = jnp.maximum(jnp.sum(keep, axis=-1), 1)
        cut = jnp.take_along_axis(vals, (n - 1)[:, None], axis=-1)  # [S, 1]
        # A row without filters keeps every token: its f32 cumsum can reach top_p = 1
        # before the tail, which would drop tokens only because a neighbour filters.
        return ~filters[:, None] | (scaled >= cut)

    filters = (sp.top_k > 0) | (sp.top_p < 1.0) | (sp.min_p > 0.0)  # [S]
    return jax.lax.cond(jnp.any(filters), cutoff, lambda x: jnp.ones(x.shape, jnp.bool_), scaled)


def _fmix(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finalizer: a cheap, well-mixed integer hash."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def gumbel_noise(sp: SamplingArrays, vocab: int) -> jax.Array:  # [S, V] f32
    """Counter-based noise: a hash of (seed, output index, token id), nothing else, so a
    row's draw never depends on its batch. (A hash compiles in a fraction of the time
    threefry takes on CPU; its 24-bit uniforms are plenty for sampling.)"""
    row = _fmix(_fmix(_fmix(sp.seed_hi ^ jnp.uint32(0x9E3779B9)) ^ sp.seed_lo)
                ^ sp.out_index.astype(jnp.uint32))  # [S]
    v = jnp.arange(vocab, dtype=jnp.uint32)[None, :]
    h = _fmix(_fmix(row[:, None] ^ (v * jnp.uint32(0x9E3779B1))) + jnp.uint32(0x7F4A7C15))
    u = ((h >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))  # (0, 1)
    return -jnp.log(-jnp.log(u))


def sample(logits: jax.Array,  # [S, V] f32
           sp: SamplingArrays) -> SampleOutput:
    logits_in = logits
    logits = apply_allowed(apply_bias(apply_penalties(logits, sp), sp), logits, sp)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(logits):
        temp = jnp.where(sp.temperature > 0, sp.temperature, 1.0)[:, None]
        scaled = logits / temp
        masked = jnp.where(filter_mask(scaled, sp), scaled, -jnp.inf)
        return jnp.argmax(masked + gumbel_noise(sp, masked.shape[-1]), axis=-1).astype(jnp.int32)

    sampled = jax.lax.cond(jnp.any(sp.temperature > 0), draw, lambda x: greedy, logits)
    tokens = jnp.where(sp.temperature > 0, sampled, greedy)
    n = min(MAX_LOGPROBS, logits.shape[-1])

    # The raw log-softmax only when some row asked for logprobs (the host reads a row's
    # logprobs only then): on XLA:CPU its exp over [S, V] was about half of a greedy
    # sampler's time (benchmarks/RESULTS.md, "Decode buckets on SmolLM2-135M").
    def top(raw_logits):
        raw = jax.nn.log_softmax(raw_logits, axis=-1)
        chosen = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
        lp, ids = jax.lax.top_k(raw, n)
        return chosen, ids.astype(jnp.int32), lp

    def none(raw_logits):
        s = raw_logits.shape[0]
        return (jnp.zeros(s, raw_logits.dtype), jnp.zeros((s, n), jnp.int32),
                jnp.zeros((s, n), raw_logits.dtype))

    chosen, top_ids, top_lps = jax.lax.cond(jnp.any(sp.want_logprobs), top, none, logits_in)
    return SampleOutput(tokens, chosen, top_ids, top_lps)
