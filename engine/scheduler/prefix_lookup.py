"""A request's pages against the prefix caches: which of its prompt's full pages are
cached, on the device (the block manager) or in the host tier (engine/kv_tier/host.py,
read back before the step as a `Restore`), and which pages a step computed, published to
the device's cache so later prompts can share them.

Pages are named by hash chains over whole pages (block_manager.prefix_hashes, with the
request's cache_salt); a request's chain is memoized in req.page_hashes and grows as its
tokens do. A linear-attention hybrid can resume only where a state snapshot is kept
(state_snapshots.py), so its hit is cut back to one.
"""

from __future__ import annotations

from jaxfill.engine.block_manager import BlockManager, prefix_hashes
from jaxfill.engine.request import Request
from jaxfill.engine.scheduler.step_plan import Restore


class PrefixLookup:
    def __init__(self, bm: BlockManager, page_size: int, tier=None, snapshots=None):
        self.bm = bm
        self.page_size = page_size
        self.tier = tier  # engine.kv_tier.host.HostKVTier, shared by the replicas; None = off
        self.snapshots = snapshots  # the scheduler's StateSnapshots (hybrids with prefix caching), else None

    def hashes(self, req: Request, upto_tokens: int) -> list[bytes]:
        """Full-page hashes of the request's first `upto_tokens` tokens (memoized)."""
        full = upto_tokens // self.page_size
        if len(req.page_hashes) < full:
            ids = req.all_ids()[:full * self.page_size]
            if req.images is not None:  # an image's rows hash as its digest, not its placeholder id
                ids = req.images.hash_ids(ids)
            parent = req.page_hashes[-1] if req.page_hashes else None
            salt = req.params.cache_salt  # an adapter's pages are its own (engine/lora/slots.py)
            if req.lora_key is not None:
                salt = f"{salt or ''}\x00lora:{req.lora_key}"
            req.page_hashes += prefix_hashes(ids, self.page_size, salt,
                                             start=len(req.page_hashes), parent=parent)
        return req.page_hashes[:full]

    def device_prefix(self, req: Request) -> list[int]:
        """Pages of the longest prefix cached on the device of all but the request's last
        token (that one must be computed to sample); [] with prefix caching off."""
        if not self.bm.enable_prefix_caching:
            return []
        return self.bm.lookup(self.hashes(req, req.num_tokens - 1))

    def hits(self, req: Request) -> list:
        """Per page of the longest prefix cached in any tier: its device page, or a Restore."""
        if not self.bm.enable_prefix_caching or req.params.prompt_logprobs is not None or (
                req.pooling is not None and req.pooling.every_row):
            return []  # prompt_logprobs (mean / cls pooling) needs every prompt row: a cached prefix is recomputed
        hits: list = []
        for h in self.hashes(req, req.num_tokens - 1):
            page = self.bm.page_of(h)
            tier = None if page is not None or self.tier is None else self.tier.peek(h)
            if page is None and tier is None:
                break
            hits.append(page if page is not None else Restore(h, tier))
        if self.snapshots is not None:  # a hybrid resumes only where a state snapshot is kept
            hits = hits[:self.snapshots.resume_pages(req.page_hashes[:len(hits)], self.page_size)]
        return hits

    def count_tier_queries(self, req: Request, hits: list, restores: list[Restore]) -> None:
        """Pages asked of the host tier (and of its disk) at an admission; their hits are
        counted once written back (transitions.py `restored`). A hit that ended before the
        last full page asked the tier once more."""
        missed = len(hits) < len(self.hashes(req, req.num_tokens - 1))
        self.tier.counts.queries += len(restores) + missed
        if self.tier.disk is not None:
            self.tier.disk.counts.queries += sum(1 for r in restores if r.tier == "disk") + missed

    def publish(self, req: Request, upto: int | None = None, start: int = 0) -> None:
        """Publishes the request's full pages computed up to `upto` tokens (default: all
        computed; async scheduling passes the step whose results arrived). Pages ending
        before `start` (the chunk's first token) were published when they were computed or
        hit, so a step only walks its own chunk's pages, not the whole context."""
        if not self.bm.enable_prefix_caching:
            return
        hashes = self.hashes(req, req.num_computed if upto is None else upto)
        for i in range(start // self.page_size, min(len(req.pages), len(hashes))):
            self.bm.register(req.pages[i], hashes[i], parent=hashes[i - 1] if i else None, token_at=req.token,
                             first=i * self.page_size)
