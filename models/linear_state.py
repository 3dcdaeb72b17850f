"""A linear layer's cache entry (models/mixers/gated_deltanet.py, mamba2.py, short_conv.py): per-sequence
state in slots, beside the attention layers' pages in the KVCache: one pool of slots per data
replica on axis 0, split over 'data' like the page pool (`state_row`), and over 'tensor' on
axis 1 (models/sharding.linear_state_sharding): the recurrent state by head,
the conv history by channel, which both mixers lay out group by group (Gated DeltaNet's
key-head groups [q_g, k_g, v_g], Mamba2's groups [x_g, B_g, C_g]) so a rank's share is
one contiguous block."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxfill.models.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LinearState:
    """One linear layer's per-sequence state, in slots."""

    recurrent: jax.Array  # [slots, Hv, Dk, Dv] f32 (Mamba2: [slots, H, N, P]; short conv: [slots, 0])
    conv: jax.Array  # [slots, conv_dim, kernel - 1] in the model dtype, channels group by group


class PagesAndState(NamedTuple):
    """The cache entry of a layer that runs attention and a linear mixer side by side
    (Falcon-H1, linear.parallel): its KV pages and its LinearState. Every reader of the
    per-layer cache goes through `split_entry` / `joined_entry`, so such a layer's pages
    count, move and tier as an attention layer's and its state as a linear layer's."""

    pages: Any  # [num_pages, page_size, 2 * Hkv, D] or QuantizedPages
    state: LinearState


def split_entry(entry) -> tuple[Any, LinearState | None]:
    """One cache entry -> (its pages or None, its LinearState or None)."""
    if entry is None:
        return None, None
    if isinstance(entry, PagesAndState):
        return entry.pages, entry.state
    if isinstance(entry, LinearState):
        return None, entry
    return entry, None


def joined_entry(pages, state):
    """The entry holding these pages and / or this state (the inverse of split_entry)."""
    if pages is not None and state is not None:
        return PagesAndState(pages, state)
    return state if pages is None else pages


def cache_states(entries) -> list[LinearState]:
    """The LinearStates of a cache's entries, in layer order (linear and parallel layers)."""
    return [s for s in (split_entry(e)[1] for e in entries) if s is not None]


def conv_dim(c: ModelConfig) -> int:
    """Channels of the convolution: q, k, v (Gated DeltaNet), x, B, C (Mamba2), or the hidden
    size (LFM2's short convolution)."""
    if c.linear.kind == "short_conv":
        return c.hidden_size
    return 2 * c.linear.num_key_heads * c.linear.key_head_dim + c.linear.num_value_heads * c.linear.value_head_dim


def recurrent_shape(c: ModelConfig) -> tuple[int, ...]:
    """One sequence's recurrent state: [Hv, Dk, Dv]; [0] for the short convolution, which
    has none (an empty array keeps every slot copy, snapshot and transfer one code path)."""
    if c.linear.kind == "short_conv":
        return (0,)
    return (c.linear.num_value_heads, c.linear.key_head_dim, c.linear.value_head_dim)


def state_bytes_per_sequence(c: ModelConfig, heads_split: int = 1) -> int:
    """One sequence's state over every linear layer (recurrent f32 + conv history in the
    model dtype), on one of `heads_split` ranks when the value heads split."""
    recurrent = math.prod(recurrent_shape(c)) * 4
    conv = conv_dim(c) * (c.linear.conv_kernel - 1) * jnp.dtype(c.jnp_dtype).itemsize
    return len(c.linear.layers) * (recurrent + conv) // heads_split


def state_row(pool_slots: int, replica: int, slot: int) -> int:
    """Replica `replica`'s state slot `slot` (the scheduler's ids are local to its replica) as
    a row of the state arrays, which hold one pool of `pool_slots` (engine.state_pool_slots)
    per data replica (models/kv_cache.py): what copies, exports and imports outside the
    data-parallel forward index by."""
    return replica * pool_slots + slot


def init_linear_state(c: ModelConfig, slots: int, fill_value: float = 0.0) -> LinearState:
    return LinearState(jnp.full((slots, *recurrent_shape(c)), fill_value, jnp.float32),
                       jnp.full((slots, conv_dim(c), c.linear.conv_kernel - 1), fill_value, c.jnp_dtype))


def _copy(entry, src, dst, stacked: bool):  # src, dst: [N] int32 slots
    pages, state = split_entry(entry)
    if state is None:
        return entry  # an attention layer's pages
    if stacked:  # [groups, slots, ...] (engine.scan_layers): the slots of every group's layer
        state = LinearState(state.recurrent.at[:, dst].set(state.recurrent[:, src]),
                            state.conv.at[:, dst].set(state.conv[:, src]))
    else:
        state = LinearState(state.recurrent.at[dst].set(state.recurrent[src]), state.conv.at[dst].set(state.conv[src]))
    return joined_entry(pages, state)  # a parallel layer's state is copied too, its pages kept


@functools.partial(jax.jit, donate_argnums=0)
def copy_state_slots(cache,
                     first_src: jax.Array,  # [N] int32
                     first_dst: jax.Array,  # [N] int32
                     then_src: jax.Array,  # [N] int32
                     then_dst: jax.Array,  # [N] int32
                     ):
    """Every linear (and parallel) layer's slots copied src -> dst, the `first` pairs before the `then`
    pairs (state snapshots taken, then restored into working slots: a restore may read a
    snapshot written by the first round). Padding pairs copy the null slot onto itself."""
    stacked = cache.stages > 1
    pages = tuple(_copy(_copy(e, first_src, first_dst, stacked), then_src, then_dst, stacked) for e in cache.pages)
    return dataclasses.replace(cache, pages=pages)
