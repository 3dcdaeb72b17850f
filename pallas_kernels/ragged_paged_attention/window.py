"""Where a row's keys start: the one rule every impl (and the ring) masks and bounds with.

A sliding window of W keys (Mistral, Gemma) starts W - 1 positions before the row. A
chunk of C positions (Llama 4's local layers, `attention_chunk`) is no window: the row
sees only keys of its own fixed chunk [k C, (k + 1) C), so the first row of a chunk sees
itself alone whatever came before. Both starts grow with the row's position, so a block
of rows starts its KV loop at its first row's start and sees blocks from its last row's
start in full (work_items.item_bounds)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def window_start(pos: jax.Array,  # int32, any shape: query positions
                 sliding_window: int | None,
                 attention_chunk: int | None,
                 ) -> jax.Array | None:  # int32, pos's shape: the first visible key position
    """None when neither limits the row (it sees keys from 0); with both, the later start.
    lax.rem on a clamped non-negative position: truncating, which XLA, Mosaic and Triton
    all lower (a padding row's negative position only ever masks its own unused output)."""
    start = None
    if sliding_window is not None:
        start = pos - (sliding_window - 1)
    if attention_chunk is not None:
        chunk = pos - lax.rem(jnp.maximum(pos, 0), jnp.int32(attention_chunk))
        start = chunk if start is None else jnp.maximum(start, chunk)
    return start


def in_window(key_pos: jax.Array, row_pos: jax.Array,  # int32, broadcastable
              sliding_window: int | None, attention_chunk: int | None) -> jax.Array | None:  # bool
    """key_pos >= the row's window start, or None when every earlier key is in."""
    start = window_start(row_pos, sliding_window, attention_chunk)
    return None if start is None else key_pos >= start
