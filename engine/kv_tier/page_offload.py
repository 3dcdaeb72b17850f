"""Moves prefix-cache pages between the device pool and the host tier (engine/kv_tier/host.py).

Saves: when allocation evicts a full cached page (engine/block_manager.py `on_evict`),
the page is queued here. Before anything next writes the cache (a step, a restore, a
disaggregated import) `save_evicted` dispatches one gather of every queued page, all
layers of a page side by side, and starts its copy to the host; device work is ordered,
so the gather reads the pages before the write that reuses them. `poll` folds the
copies that have arrived into the host tier; nothing ever waits for one. At most
`max_staged_pages` pages are in transit: past that a save is dropped (counted), never
waited for.

Restores: the scheduler admits a request whose prefix continues in the host tier with
fresh pages for those blocks (engine/scheduler/batching.py); `restore` scatters the blocks
into them before the step that reads them (one scatter for the step's restores).

Multi-process (jax.distributed): every process keeps its own host tier of whole blocks
(the gather is replicated, so each reads its copy from a local device). Process 0 alone
looks up and decides; its saves and restores reach the others as lockstep messages
(engine/runner.py), and every process folds arrived saves only at the same points of the
message stream (`sync`), so all tiers hold the same blocks in the same LRU order and a
block process 0 restores is there on every process. No disk tier there yet.

Both move at most MAX_PAGES_PER_CALL pages a call and pad the count to a power of two
with the null page, whose gathered rows are dropped and whose scattered rows are
skipped: 2 x 7 programs in all, compiled by `warmup` before the engine reports ready. Blocks carry the
model's KV heads only, as engine/kv_rows.py's rows do (a cache repeating heads for mesh.tensor
keeps one copy); under mesh.data the page ids are global (replica * pages + page).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxfill.engine import kv_rows
from jaxfill.engine.kv_tier.host import KVBlock

log = logging.getLogger("jaxfill.kv_tier")

MAX_PAGES_PER_CALL = 64  # larger saves and restores take several calls (no bigger shapes)


def padded_count(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def call_sizes() -> list[int]:
    """Every padded page count a gather or scatter is compiled for: 1, 2, 4, ... 64."""
    return [1 << i for i in range(MAX_PAGES_PER_CALL.bit_length())]


@functools.partial(jax.jit, static_argnames=("num_kv_heads", "stages", "replicate"))
def gather_blocks(pages: tuple,  # KVCache.pages: per layer [N, P, 2*Hc, D] or stacked [p, N, ...]
                  page_ids: jax.Array,  # [n] int32
                  num_kv_heads: int,
                  stages: int = 1,
                  replicate: bool = False):  # True: a whole copy on every device (inside jax.set_mesh)
    """-> values [n, L, P, 2*Hkv, D], scales [n, L, P, 2*Hkv] or None: one block per page."""
    n = page_ids.shape[0]

    def per_page(a):  # [L, n*P, ...] -> [n, L, P, ...]
        a = a.reshape((a.shape[0], n, a.shape[1] // n) + a.shape[2:])
        a = jnp.moveaxis(a, 1, 0)
        return jax.lax.with_sharding_constraint(a, jax.sharding.PartitionSpec()) if replicate else a

    values, scales = kv_rows.gather_tokens(pages, page_ids, num_kv_heads=num_kv_heads, stages=stages)
    return per_page(values), None if scales is None else per_page(scales)


@functools.partial(jax.jit, donate_argnums=(0,), static_argnames=("stages",))
def scatter_blocks(pages: tuple,  # KVCache.pages (donated)
                   values: jax.Array,  # [n, L, P, 2*Hkv, D]
                   scales: jax.Array | None,  # [n, L, P, 2*Hkv] or None
                   page_ids: jax.Array,  # [n] int32; -1 = skip this block
                   stages: int = 1):
    """Writes block i into page page_ids[i] (every layer), through engine/kv_rows.py's scatter."""
    n, size = values.shape[0], values.shape[2]

    def rows(a):  # [n, L, P, ...] -> [L, n*P, ...]
        a = jnp.moveaxis(a, 0, 1)
        return a.reshape((a.shape[0], n * size) + a.shape[3:])

    offsets = jnp.arange(size, dtype=jnp.int32)
    slots = jnp.where(page_ids[:, None] >= 0, page_ids[:, None] * size + offsets, -1).reshape(n * size)
    return kv_rows.scatter_tokens(pages, rows(values), None if scales is None else rows(scales), slots, stages=stages)


@dataclasses.dataclass
class _Save:
    hashes: list  # (hash, parent, tokens) per real page
    values: jax.Array  # [n, L, P, 2*Hkv, D], on its way to the host
    scales: jax.Array | None


class KVOffload:
    def __init__(self, tier, num_kv_heads: int, pages_per_replica: int, stages: int, max_staged_pages: int,
                 lockstep: bool = False):
        self.tier = tier  # HostKVTier
        self.lockstep = lockstep  # a multi-process engine: fold only at `sync`, never discard alone
        self.num_kv_heads = num_kv_heads
        self.pages_per_replica = pages_per_replica
        self.stages = stages
        self.max_staged_pages = max(1, int(max_staged_pages))
        self.queued: list[tuple[int, bytes, bytes | None, tuple]] = []  # (global page, hash, parent, tokens)
        self.in_transit: list[_Save] = []
        self.num_saves_dropped = 0  # staging full: the page is recomputed if it is asked for again
        self.num_restored = 0  # pages written back into the device pool
        self.states = None  # a hybrid's state snapshots (engine/kv_tier/snapshot_offload.py), or None

    def on_evict(self, replica: int, page: int, h: bytes, parent: bytes | None, tokens: tuple) -> None:
        """A block manager's eviction callback: queue the page (still intact) for saving."""
        if h in self.tier:
            return  # already kept (restored from it, or saved from another replica's pool)
        if self._staged() + len(self.queued) >= self.max_staged_pages:
            self.poll()
        if self._staged() + len(self.queued) >= self.max_staged_pages:
            self.num_saves_dropped += 1
            return
        self.queued.append((replica * self.pages_per_replica + page, h, parent, tuple(tokens)))

    def _staged(self) -> int:
        return sum(len(s.hashes) for s in self.in_transit)

    def save_evicted(self, cache) -> None:
        """Dispatches the gather of every queued page and starts its copy to the host."""
        while self.queued:
            queued, self.queued = self.queued[:MAX_PAGES_PER_CALL], self.queued[MAX_PAGES_PER_CALL:]
            values, scales = self._gather(cache, [q[0] for q in queued])
            if self.lockstep:  # this process's whole copy
                values, scales = values.addressable_data(0), None if scales is None else scales.addressable_data(0)
            for a in (values, scales):
                if a is not None:
                    a.copy_to_host_async()
            self.in_transit.append(_Save([q[1:] for q in queued], values, scales))

    def _gather(self, cache, pages: list[int]):
        ids = np.zeros(padded_count(len(pages)), np.int32)  # the null page pads
        ids[:len(pages)] = pages
        return gather_blocks(kv_rows.paged_entries(cache), jnp.asarray(ids), num_kv_heads=self.num_kv_heads,
                             stages=self.stages, replicate=self.lockstep)

    def sync(self) -> None:
        """Multi-process: every process folds its arrived saves here, at the same point of
        the lockstep stream (a save, a restore, a step), so their tiers stay equal."""
        if self.lockstep:
            self._fold(wait=True)

    def poll(self, wait: bool = False) -> int:
        """Folds the saves that reached the host into the tier (`wait`: all of them, for
        tests and shutdown); returns the pages folded in. Multi-process: only `sync` folds."""
        if self.states is not None:
            self.states.poll(wait)
        return 0 if self.lockstep else self._fold(wait)

    def _fold(self, wait: bool) -> int:
        done = 0
        while self.in_transit:
            save = self.in_transit[0]
            arrays = [a for a in (save.values, save.scales) if a is not None]
            if not wait and not all(a.is_ready() for a in arrays):
                break
            self.in_transit.pop(0)
            values = np.asarray(save.values)
            scales = None if save.scales is None else np.asarray(save.scales)
            for i, (h, parent, tokens) in enumerate(save.hashes):  # copies: a block owns its bytes
                self.tier.put(h, KVBlock(values[i].copy(), None if scales is None else scales[i].copy(),
                                         parent, tokens))
            done += len(save.hashes)
        return done

    def flush(self) -> None:
        """Waits for every save in transit, and for the disk tier's writes (shutdown, tests)."""
        if not self.lockstep:
            self._fold(wait=True)
        if self.states is not None:
            self.states.poll(wait=True)
        if self.tier.disk is not None:
            self.tier.disk.flush()

    def discard(self, hashes) -> None:
        """Blocks whose restore failed leave the tier, so they are recomputed; not in a
        multi-process engine, where process 0 alone dropping them would split the tiers."""
        if not self.lockstep:
            self.tier.discard(*hashes)

    def drop_queued(self) -> None:
        """The device cache was lost: pages queued for saving no longer hold their K/V."""
        self.queued.clear()

    def restore(self, cache, pages: list[int], blocks: list[KVBlock]):
        """A new cache.pages with each block scattered into its (global) page; the old
        pages are donated (a hybrid's state slots pass through). Saves still queued are
        dispatched first, so they read the pages before this write."""
        self.save_evicted(cache)
        new_pages = kv_rows.paged_entries(cache)
        for at in range(0, len(blocks), MAX_PAGES_PER_CALL):
            part = blocks[at:at + MAX_PAGES_PER_CALL]
            new_pages = self._scatter(cache, new_pages, pages[at:at + MAX_PAGES_PER_CALL], part[0],
                                      [b.values for b in part], [b.scales for b in part])
        self.num_restored += len(blocks)
        return kv_rows.with_paged(cache, new_pages).pages

    def _scatter(self, cache, pages_tree, pages: list[int], like: KVBlock, values: list, scales: list):
        n = padded_count(len(pages))
        ids = np.full(n, -1, np.int32)
        ids[:len(pages)] = pages
        v = np.zeros((n,) + like.values.shape, like.values.dtype)
        if values:
            v[:len(values)] = values
        s = None
        if like.scales is not None:
            s = np.zeros((n,) + like.scales.shape, np.float32)
            if scales:
                s[:len(scales)] = scales
        v, s = _placed(cache, v), None if s is None else _placed(cache, s)
        return scatter_blocks(pages_tree, v, s, jnp.asarray(ids), stages=self.stages)

    def warmup(self, cache):
        """Compiles every gather and scatter size on the real cache (the gathers read the
        null page; the scatters write nothing); returns the cache's new pages."""
        for n in call_sizes():
            values, scales = self._gather(cache, [0] * n)
            block = KVBlock(np.asarray(values[0]), None if scales is None else np.asarray(scales[0]), None, ())
            cache = kv_rows.with_paged(cache, self._scatter(cache, kv_rows.paged_entries(cache), [-1] * n, block, [], []))
        return cache.pages

    @staticmethod
    def cache_size() -> int:
        return gather_blocks._cache_size() + scatter_blocks._cache_size()

    def stats(self) -> dict:
        return {**self.tier.stats(), "host_kv_saves_in_transit": self._staged() + len(self.queued),
                "host_kv_saves_dropped": self.num_saves_dropped, "host_kv_pages_restored": self.num_restored,
                **(self.states.stats() if self.states is not None else {})}


def _placed(cache, a: np.ndarray) -> jax.Array:
    """Host blocks onto the cache's devices: replicated over its mesh (the jitted scatter
    reshards them; in a multi-process run each process gives its local devices its own
    copy), or onto its one device."""
    sharding = jax.tree.leaves(cache.pages)[0].sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        replicated = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
        return jax.make_array_from_callback(a.shape, replicated, lambda index: a[index])
    return jax.device_put(a, next(iter(sharding.device_set)))


def encode_entries(pages: list[int], hashes: list[bytes]) -> np.ndarray:
    """A lockstep message's words: [n, page ids..., 4 words of each 16-byte hash...]."""
    words = np.frombuffer(b"".join(hashes), np.int32) if hashes else np.zeros(0, np.int32)
    return np.concatenate([np.asarray([len(pages)] + list(pages), np.int32), words])


def decode_entries(words: np.ndarray) -> tuple[list[int], list[bytes]]:
    n = int(words[0])
    raw = np.ascontiguousarray(words[1 + n:1 + n + 4 * n]).tobytes()
    return [int(p) for p in words[1:1 + n]], [raw[16 * i:16 * (i + 1)] for i in range(n)]


def build_kv_offload(config, cache, stages: int) -> KVOffload | None:
    """The host tier (and its disk tier) engine.host_kv_cache_gb asks for; None when off."""
    s = config.engine
    if not float(s.host_kv_cache_gb) > 0:
        return None
    lockstep = jax.process_count() > 1  # the disk tier is refused then (engine/capabilities/table.py)
    from jaxfill.engine.kv_tier.disk import DiskKVTier
    from jaxfill.engine.kv_tier.disk_format import fingerprint
    from jaxfill.engine.kv_tier.host import HostKVTier
    from jaxfill.models.kv_cache import kv_bytes_per_token, shares_kv
    from jaxfill.models.linear_state import cache_states

    m = config.model
    layout = kv_rows.Layout.of(config, cache)
    attention_layers = len(kv_rows.paged_entries(cache)) * cache.stages  # a hybrid's linear layers hold no pages
    block_bytes = s.page_size * kv_bytes_per_token(attention_layers, m.num_kv_heads, m.head_dim, s.kv_cache_dtype,
                                                   m.jnp_dtype, shares_kv(m))
    # a hybrid's snapshot (every linear layer's state of one slot; at most this, the pool's
    # bytes over its slots per replica) may outweigh a block: the disk queue takes a few
    snapshot_bytes = sum(a.nbytes for e in cache_states(cache.pages) for a in (e.recurrent, e.conv))
    snapshot_bytes //= max(1, s.state_pool_slots if s.state_slots else 1)
    disk = None
    if s.disk_kv_cache_dir:
        disk = DiskKVTier(s.disk_kv_cache_dir, int(float(s.disk_kv_cache_gb) * 2**30),
                          fingerprint(config, layout.to_json()),
                          max_queued_bytes=max(int(float(s.host_kv_cache_gb) * 2**30), 16 * block_bytes,
                                               4 * snapshot_bytes))
    tier = HostKVTier(int(float(s.host_kv_cache_gb) * 2**30), disk)
    pages = tier.budget_bytes // block_bytes
    log.info("host KV tier: %.1f MiB hold %d pages (%d tokens, %d bytes a page)%s", tier.budget_bytes / 2**20,
             pages, pages * s.page_size, block_bytes,
             f"; disk tier {s.disk_kv_cache_dir}: {disk.budget_bytes / 2**20:.1f} MiB" if disk else "")
    # Staged saves hold device memory until they reach the host: enough for a long prompt's
    # admission (whose fresh pages can evict that many at once), never more than the tier holds.
    staged = min(max(pages // 8, 2 * s.max_pages_per_seq, 64), max(pages, 1))
    offload = KVOffload(tier, m.num_kv_heads, s.num_pages, stages, max_staged_pages=staged, lockstep=lockstep)
    if s.state_slots and s.enable_prefix_caching and s.state_snapshot_slots:  # a hybrid's snapshots go too
        from jaxfill.engine.kv_tier.snapshot_offload import SnapshotOffload

        offload.states = SnapshotOffload(tier)
    return offload
