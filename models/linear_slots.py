"""A linear layer's per-sequence state in its slots (models/linear_state.py), read before a
step and written after it: the bookkeeping every linear mixer (Gated DeltaNet, Mamba2)
shares.

A sequence's slot is `meta.state_slots` (its batch row when absent). A sequence with
nothing cached (kv_len == its new rows) starts from zeros whatever its slot holds, so a
reused slot can never leak another request's state into a fresh one; padding rows (past
`num_seqs`) read zeros and write nowhere.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxfill.models.kv_cache import AttentionMetadata
from jaxfill.models.linear_state import LinearState


class SlotRead(NamedTuple):
    slots: jax.Array  # [S] int32, each sequence's slot (clipped into the pool)
    live: jax.Array  # [S] bool, a real sequence (not padding)
    recurrent: jax.Array  # [S, ...] f32, each sequence's state before its rows
    conv: jax.Array  # [S, conv_dim, K-1], its convolution history


def read_slots(state: LinearState, meta: AttentionMetadata) -> SlotRead:
    s = meta.kv_lens.shape[0]
    live = jnp.arange(s) < meta.num_seqs[0]
    fresh = meta.kv_lens == jnp.diff(meta.cu_q_lens)  # nothing cached before this step's rows
    slots = meta.state_slots if meta.state_slots is not None else jnp.arange(s, dtype=jnp.int32)
    slots = jnp.clip(slots, 0, state.recurrent.shape[0] - 1)
    keep = live & ~fresh
    recurrent = state.recurrent[slots]
    recurrent = jnp.where(keep.reshape((-1,) + (1,) * (recurrent.ndim - 1)), recurrent, 0.0)
    conv = jnp.where(keep[:, None, None], state.conv[slots], jnp.zeros((), state.conv.dtype))
    return SlotRead(slots, live, recurrent, conv)


def write_slots(state: LinearState, read: SlotRead,
                recurrent: jax.Array,  # [S, ...] each sequence's state after its rows
                conv: jax.Array,  # [S, conv_dim, K-1]
                ) -> LinearState:
    dropped = jnp.where(read.live, read.slots, state.recurrent.shape[0])  # padding rows write nowhere
    return LinearState(state.recurrent.at[dropped].set(recurrent.astype(state.recurrent.dtype), mode="drop"),
                       state.conv.at[dropped].set(conv.astype(state.conv.dtype), mode="drop"))
