"""The step with the MTP proposer (speculative.method = "mtp"): the target's forward and
sampler, then the MTP layer over the same rows, in one jitted program per bucket.

Why one program and not a second one after the step: the MTP layer needs the target's
final-norm hidden state of every row [T, E] and the tokens the step samples; inside the
program they never leave the device, and no second dispatch per step is paid. The cost is
the target's last layer run on every row (the plain step runs it on the sampled rows only)
and one more decoder layer over the rows: about 1/L + 1/L of a prefill, and on a decode
step (rows = sequences) the same two layers' worth, for a proposal that saves a whole step
when it is accepted.

What the layer reads is engine/speculative/mtp_rows.py's; the proposal of sequence i is the
argmax of its last accepted row's MTP logits (a point-mass draft: exact under the acceptance
rule of acceptance.py whatever the request's sampler), in SampleOutput.mtp [S].
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfill.engine.batch import StepBatch
from jaxfill.engine.sampler import SampleOutput
from jaxfill.engine.step import _step_body, take_in_flight
from jaxfill.models.kv_cache import KVCache


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=2)
def step_mtp(graph, state: nnx.State, kv_cache: KVCache,
             batch: StepBatch,  # leaves [T] / [S, ...], with batch.mtp
             prev_tokens: jax.Array,  # [P] i32
             scores_prompt: bool = False,
             ) -> tuple[SampleOutput, KVCache, jax.Array]:  # out.mtp [S] i32 proposals
    model = nnx.merge(graph.graphdef, state)
    seen = {}

    def forward(tokens, positions, meta):
        logits, cache, hidden = model(tokens, positions, kv_cache, meta, hidden_rows=True)
        seen["hidden"] = hidden  # [T, E]
        return logits, cache

    out, cache, new_prev = _step_body(forward, batch, prev_tokens, scores_prompt)
    tokens = take_in_flight(batch, prev_tokens).tokens  # [T] the rows' inputs as the target saw them
    rows = batch.mtp
    s = batch.meta.logits_indices.shape[0]
    nxt = next_tokens(tokens, out.tokens, rows)
    accepted = accepted_counts(tokens, out.tokens, batch, s)  # [S]
    proposal_rows = batch.meta.logits_indices - rows.num_draft + accepted  # [S] each one's last accepted row
    meta = dataclasses.replace(batch.meta, logits_indices=proposal_rows)
    with jax.named_scope("mtp"):
        _z, logits, cache = model.mtp_forward(seen["hidden"], nxt, batch.positions, cache, meta)
    return dataclasses.replace(out, mtp=jnp.argmax(logits, axis=-1).astype(jnp.int32)), cache, new_prev


def next_tokens(tokens: jax.Array,  # [T] i32 the step's input tokens
                sampled: jax.Array,  # [S + Q] i32 the step's sampled tokens
                rows) -> jax.Array:  # MTPRows -> [T] i32 the token after each row
    following = jnp.concatenate([tokens[1:], tokens[:1]])  # row t + 1's input (-2 rows)
    from_sample = sampled[jnp.clip(rows.next_src, 0, sampled.shape[0] - 1)]
    return jnp.where(rows.next_src == -2, following, jnp.where(rows.next_src >= 0, from_sample, rows.next_tokens))


def accepted_counts(tokens: jax.Array,  # [T] i32
                    sampled: jax.Array,  # [S + Q] i32
                    batch: StepBatch, s: int) -> jax.Array:  # [S] i32 proposals accepted per sequence
    """acceptance.accept_prefix on the device: a proposal counts while it and every earlier
    one of its sequence equal the tokens sampled at their rows."""
    verify, rows = batch.verify, batch.mtp
    if verify is None:
        return jnp.zeros((s,), jnp.int32)
    draft = tokens[jnp.minimum(verify.rows + 1, tokens.shape[0] - 1)]  # [Q] row r + 1's input: the proposal
    bad = (draft != sampled[s:]).astype(jnp.int32)
    before = jnp.cumsum(bad) - bad  # mismatches before each row, over all rows
    first = jnp.arange(bad.shape[0]) - rows.verify_index  # the sequence's first verification row
    alive = (before - before[first]) + bad == 0  # no mismatch from its first row through this one
    live = alive & (rows.verify_seq < s)
    return jax.ops.segment_sum(live.astype(jnp.int32), rows.verify_seq, num_segments=s + 1)[:s]
