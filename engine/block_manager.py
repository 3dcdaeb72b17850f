"""KV page bookkeeping on the host: free list, ref counts, prefix hashes, LRU eviction.

Pure Python, no JAX. Page 0 is the null page: never allocated, it fills the unused
columns of `page_indices` and padding sequences point at it.

One free queue holds every page with ref count 0, oldest first. A page that was full
when freed keeps its prefix hash and stays findable (a cache hit takes it back out of
the queue) until allocation reaches it at the head of the queue: that is the LRU
eviction. Requests free their pages in reverse order, so a request's tail pages (the
least shareable ones) are evicted before its head pages.

A full page's hash chains its parent's hash, its tokens and the request's cache_salt,
so equal hashes mean equal whole prefixes (and equal salts).

`listener` (None by default) hears the prefix cache change, on the stepping thread:
("stored", hash, parent hash or None, tokens) when a page becomes findable,
("removed", hash) when allocation evicts it, ("cleared",) on a reset. It must only
record (the serving loop queues the events and publishes them after the step).

`ranks` > 1 (context parallelism, mesh.sequence): the pool is dealt over the ranks, rank
r owning ids [r * P/N, (r + 1) * P/N), and a request's logical page j must come from
rank j mod N (models/parallel/context.py). Each rank has its own free queue (its own
LRU); `allocate` and `can_allocate` take the logical index of the first page asked for,
or the logical indices themselves. A prefix-cache hit needs no rule: a cached page was
allocated at the same logical index it is found at.

`on_evict` (None by default; the host tier's engine/kv_tier/page_offload.py) hears
(page, hash, parent hash, tokens) as allocation evicts a cached page, before the page is
handed out: its K/V are still intact until the next write to the cache.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from typing import Callable, Sequence

NULL_PAGE = 0


def hash_page(parent: bytes | None, tokens: Sequence[int], salt: str | None = None) -> bytes:
    """Hash of one full page given its parent's hash (None for the first page)."""
    h = hashlib.blake2b(digest_size=16)
    if parent is None:
        h.update(b"root:" + (salt or "").encode("utf-8") + b"\x00")
    else:
        h.update(parent)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


def prefix_hashes(tokens: Sequence[int], page_size: int, salt: str | None = None,
                  start: int = 0, parent: bytes | None = None) -> list[bytes]:
    """Hashes of full pages start, start + 1, ... of `tokens` (parent = hash of page start - 1)."""
    out = []
    for i in range(start, len(tokens) // page_size):
        parent = hash_page(parent, tokens[i * page_size:(i + 1) * page_size], salt)
        out.append(parent)
    return out


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True, ranks: int = 1):
        if num_pages < 2 * ranks or num_pages % ranks:
            raise ValueError(f"need a multiple of {ranks} pages, at least 2 per rank (page 0 is the null page), "
                             f"got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ranks = ranks
        self.per_rank = num_pages // ranks
        self.ref_counts = [0] * num_pages
        self.page_hash: list[bytes | None] = [None] * num_pages
        self.cached: dict[bytes, int] = {}  # hash -> page
        # one LRU queue per rank (one in all without context parallelism)
        self.free_queues: list[OrderedDict[int, None]] = [
            OrderedDict((p, None) for p in range(r * self.per_rank, (r + 1) * self.per_rank) if p != NULL_PAGE)
            for r in range(ranks)]
        self.hits = 0  # pages served from the prefix cache
        self.queries = 0  # pages looked up
        self.listener: Callable[..., None] | None = None  # prefix-cache events (see the module doc)
        self.on_evict: Callable[..., None] | None = None  # evicted pages, to save (see the module doc)
        self.page_origin: dict[int, tuple] = {}  # cached page -> (parent hash, tokens), for on_evict

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Pages that can be allocated now (free, including evictable cached pages)."""
        return sum(len(q) for q in self.free_queues)

    @property
    def free_queue(self) -> OrderedDict:
        """The one free queue (no context parallelism)."""
        if self.ranks > 1:
            raise AttributeError("a pool dealt over ranks has one free queue per rank: free_queues")
        return self.free_queues[0]

    def rank_of(self, page: int) -> int:
        return page // self.per_rank

    def _logical(self, n_or_indices, first: int) -> list[int]:
        return list(range(first, first + n_or_indices)) if isinstance(n_or_indices, int) else list(n_or_indices)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Pages of the longest cached prefix of `hashes` (no ref counts change)."""
        if not self.enable_prefix_caching:
            return []
        pages = []
        for h in hashes:
            page = self.cached.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def can_allocate(self, num_new: int | Sequence[int], hit_pages: Sequence[int] = (), first: int = 0) -> bool:
        """Whether fresh pages fit after taking `hit_pages` out of the free queues: `num_new`
        pages at logical indices first, first + 1, ..., or at the indices given."""
        free = [len(q) for q in self.free_queues]
        for p in hit_pages:
            if self.ref_counts[p] == 0:
                free[self.rank_of(p)] -= 1
        for j in self._logical(num_new, first):
            free[j % self.ranks] -= 1
        return min(free) >= 0

    # ------------------------------------------------------------------ changes
    def acquire(self, pages: Sequence[int]) -> None:
        """Takes a reference on cached pages (prefix hits)."""
        for p in pages:
            if self.ref_counts[p] == 0:
                del self.free_queues[self.rank_of(p)][p]
            self.ref_counts[p] += 1
        self.hits += len(pages)

    def allocate(self, n: int | Sequence[int], first: int = 0) -> list[int]:
        """Fresh pages for logical indices first, first + 1, ... (n of them), or for the
        indices given, each from the head of its rank's free queue, evicting cached hashes."""
        logical = self._logical(n, first)
        if not self.can_allocate(logical):
            raise MemoryError(f"need {len(logical)} pages, {self.num_free} free"
                              + (f" ({[len(q) for q in self.free_queues]} per rank)" if self.ranks > 1 else ""))
        out = []
        for j in logical:
            page, _ = self.free_queues[j % self.ranks].popitem(last=False)
            h = self.page_hash[page]
            if h is not None:
                if self.cached.get(h) == page:
                    del self.cached[h]
                    if self.listener is not None:
                        self.listener("removed", h)
                    origin = self.page_origin.pop(page, None)
                    if self.on_evict is not None and origin is not None:
                        self.on_evict(page, h, *origin)
                self.page_hash[page] = None
            self.ref_counts[page] = 1
            out.append(page)
        return out

    def free(self, pages: Sequence[int]) -> None:
        """Drops one reference per page, tail first; unreferenced pages join the free queue."""
        for p in reversed(pages):
            if p == NULL_PAGE:
                continue
            assert self.ref_counts[p] > 0, f"double free of page {p}"
            self.ref_counts[p] -= 1
            if self.ref_counts[p] == 0:
                self.free_queues[self.rank_of(p)][p] = None

    def register(self, page: int, h: bytes, parent: bytes | None = None,
                 token_at: Callable[[int], int] | None = None, first: int = 0) -> None:
        """Marks a full, computed page as holding the prefix with hash h. For a listener:
        parent is the previous page's hash, token_at(first + j) the page's j-th token."""
        if not self.enable_prefix_caching or self.page_hash[page] is not None:
            return
        if h in self.cached:  # the same prefix was computed twice: keep the first copy
            return
        self.cached[h] = page
        self.page_hash[page] = h
        if self.listener is None and self.on_evict is None:
            return
        tokens = [token_at(first + j) for j in range(self.page_size)] if token_at is not None else []
        if self.on_evict is not None:
            self.page_origin[page] = (parent, tuple(tokens))
        if self.listener is not None:
            self.listener("stored", h, parent, tokens)

    def page_of(self, h: bytes) -> int | None:
        """The device page holding the prefix with hash h, or None (prefix caching off too)."""
        return self.cached.get(h) if self.enable_prefix_caching else None

    def reset_prefix_cache(self) -> None:
        for h, p in list(self.cached.items()):
            self.page_hash[p] = None
        self.cached.clear()
        self.page_origin.clear()
        if self.listener is not None:
            self.listener("cleared")

    def check(self) -> None:
        """Invariants (tests): every page is exactly one of free / referenced."""
        for p in range(1, self.num_pages):
            assert (self.ref_counts[p] == 0) == (p in self.free_queues[self.rank_of(p)]), p
        assert all(self.rank_of(p) == r for r, q in enumerate(self.free_queues) for p in q)
        assert NULL_PAGE not in self.free_queues[0]
        for h, p in self.cached.items():
            assert self.page_hash[p] == h
