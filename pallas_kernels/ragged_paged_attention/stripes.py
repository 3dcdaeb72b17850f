"""Key positions when a sequence's pages are dealt round-robin over ranks.

Context parallelism (models/sharding.py) splits the page pool over the 'sequence' ranks:
logical page j of every sequence lives on rank j mod N. A rank's kernel sees only its
own pages, through a local page table (`page_indices[:, r::N]`), so its local key k'
(page k' // page_size, slot k' % page_size) is the sequence's key at global position

    ((k' // page_size) * N + r) * page_size + k' % page_size.

Local keys stay in position order, so every bound the kernels draw in positions (the
causal diagonal, kv_len, the sliding window's edge) is still one cut in local keys:
`local_count(x)` is how many of this rank's keys sit below global position x. With
N = 1 both maps are the identity, and the kernels' code is what it was.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class KeyStripes(NamedTuple):
    count: int  # N, static: ranks the pages are dealt over
    rank: jax.Array  # int32 scalar (traced: lax.axis_index under shard_map)
    page_size: int

    def to_global(self, local: jax.Array) -> jax.Array:  # int32, any shape
        if self.count == 1:
            return local
        ps = self.page_size
        return (lax.div(local, ps) * self.count + self.rank) * ps + lax.rem(local, ps)

    def local_count(self, x: jax.Array) -> jax.Array:  # int32, any shape; x < 0 counts 0
        if self.count == 1:
            return jnp.maximum(x, 0)
        ps = self.page_size
        span = ps * self.count
        x = jnp.maximum(x, 0)
        cycles = lax.div(x, span)
        return cycles * ps + jnp.clip(x - cycles * span - self.rank * ps, 0, ps)


def stripes(count: int, rank, page_size: int) -> KeyStripes:
    """`rank` may be None with count 1 (one device: every page is local)."""
    if count < 1:
        raise ValueError(f"kv_stride must be >= 1, got {count}")
    rank = jnp.asarray(0 if rank is None else rank, jnp.int32).reshape(())
    return KeyStripes(int(count), rank, page_size)


def local_page_table(page_indices: jax.Array,  # [S, P] int32 global page ids
                     count: int, rank: jax.Array,
                     pages_per_rank: int) -> jax.Array:  # [S, ceil(P / N)] local ids
    """Rank `rank`'s columns of the page table (logical pages r, r + N, ...), as ids into
    its own slice of the pool (global id - rank * pages_per_rank). Columns past a
    sequence's pages point at the null page (0) and become negative: kernels clip them,
    and kv_len keeps them out of every result."""
    s, p = page_indices.shape
    width = -(-p // count)
    padded = jnp.pad(page_indices, ((0, 0), (0, width * count - p)))
    mine = lax.dynamic_index_in_dim(padded.reshape(s, width, count), rank, axis=2, keepdims=False)
    return jnp.maximum(mine - rank * pages_per_rank, 0).astype(jnp.int32)


def local_slots(slot_mapping: jax.Array,  # [T] int32 global slots, < 0 for padding
                rank: jax.Array, pages_per_rank: int, page_size: int) -> jax.Array:  # [T]
    """Slots of rows whose page lives on `rank`, as slots of its pool slice; every other
    row gets -1 (written by its owner, skipped here)."""
    span = pages_per_rank * page_size
    local = slot_mapping - rank * span
    return jnp.where((slot_mapping >= 0) & (local >= 0) & (local < span), local, -1).astype(jnp.int32)
