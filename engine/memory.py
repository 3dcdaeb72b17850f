"""`engine.num_pages = 0`: the KV pool sized from the memory a device has left.

Per device, after the weights are placed:

    per_device = floor((capacity * memory_utilization - in_use - activation_peak) / page_bytes)
    num_pages = mesh.sequence x per_device


* capacity, in_use: GPU/TPU: `device.memory_stats()` `bytes_limit` and `bytes_in_use`
  (the weights and anything else already resident). `bytes_limit` is the XLA allocator's
  limit, not the HBM size: on GPU, by default 75% of it (XLA_PYTHON_CLIENT_MEM_FRACTION),
  so the planner's `kv_pool_pages`, which starts from the hardware table's HBM, is an
  upper bound there (not checked on a GPU). CPU has no memory_stats: capacity =
  MemAvailable (/proc/meminfo) / (this process's mesh devices) + in_use, in_use = this
  device's param bytes; i.e. its share of the RAM free now plus what its weights already
  take, so the same utilization means the same thing as on an accelerator. Then capped:
  the process's pool at most `engine.cpu_kv_cache_gb` GiB (split over its devices), since
  the host's RAM also holds everything else a CPU user runs.
* activation_peak: `temp_size_in_bytes` of the largest bucket's compiled step (XLA's
  memory_analysis), compiled with a 2-page cache before the pool exists: the cache is
  donated and updated in place, so its size does not enter the temp buffers.
* page_bytes: one page of every layer as this device stores it: the heads it holds
  (Hkv, repeated up to mesh.tensor, split over tensor) in engine.kv_cache_dtype, scales
  included. The page axis holds one pool per data replica split over 'data', and each
  replica's pool is split over 'sequence' (page j of a sequence on rank j mod N, each
  rank holding num_pages / N), so the pool of one replica is N times what one device
  fits: a multiple of N, as engine.num_pages must be.

The smallest device decides (the cache has one shape), and in a multi-process run the
smallest process. `jaxfill plan` calls `pool_pages` with its arithmetic inputs.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np

from jaxfill.engine import activation_cache
from jaxfill.models.linear_state import cache_states

log = logging.getLogger("jaxfill.memory")

MEMINFO = "/proc/meminfo"


@dataclasses.dataclass(frozen=True)
class PoolSize:
    """How the pool was sized (per device) and what fits: the log line and GetModelInfo."""

    num_pages: int  # per data replica, null page 0 included
    page_size: int
    page_bytes: int  # one page, every layer, on one device
    capacity_bytes: int
    in_use_bytes: int
    activation_bytes: int
    utilization: float
    source: str  # where capacity came from

    @property
    def tokens(self) -> int:
        """Tokens the pool holds (the null page holds none)."""
        return (self.num_pages - 1) * self.page_size

    def describe(self) -> str:
        mib = lambda n: f"{n / (1 << 20):.1f} MiB"  # noqa: E731
        return (f"KV pool: {self.num_pages} pages x {self.page_size} = {self.tokens} tokens per replica "
                f"({self.page_bytes} B/page/device) from {self.source}: {mib(self.capacity_bytes)} x "
                f"{self.utilization:g} - in use {mib(self.in_use_bytes)} - activations {mib(self.activation_bytes)}")


def pool_pages(capacity_bytes: float, in_use_bytes: float, activation_bytes: float, page_bytes: int,
               utilization: float, sequence: int = 1) -> int:
    """The formula, shared by the engine and the planner: pages of one replica's pool,
    `sequence` times what one device fits (may be < 2 per rank: callers check)."""
    if page_bytes <= 0:
        raise ValueError(f"page_bytes must be positive, got {page_bytes}")
    if sequence < 1:
        raise ValueError(f"sequence must be at least 1, got {sequence}")
    usable = capacity_bytes * utilization - in_use_bytes - activation_bytes
    return sequence * max(0, int(usable // page_bytes))


def cpu_cap_pages(cap_gb: float, devices: int, page_bytes: int, sequence: int = 1) -> int:
    """Pages of one replica's pool that `engine.cpu_kv_cache_gb` allows a process of `devices`
    devices (shared by the engine and the planner)."""
    return sequence * int(cap_gb * (1 << 30) / devices // page_bytes)


def host_memory_available() -> int:
    """MemAvailable from /proc/meminfo, bytes (what Linux can give without swapping)."""
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError as e:
        raise RuntimeError(f"engine.num_pages=0 on CPU reads {MEMINFO}: {e}; set engine.num_pages") from None
    raise RuntimeError(f"no MemAvailable in {MEMINFO}; set engine.num_pages")


def shard_bytes(tree, device) -> int:
    """Bytes of `tree`'s arrays that live on `device`."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        for shard in getattr(leaf, "addressable_shards", ()):
            if shard.device == device:
                total += shard.data.nbytes
    return total


def device_memory(device, params, sharing: int) -> tuple[int, int, str]:
    """(capacity, in_use, source) of one device, read now; on CPU `sharing` devices of this
    process split the host's RAM."""
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]), int(stats["bytes_in_use"]), f"{device.platform} memory_stats"
    in_use = shard_bytes(params, device)
    return host_memory_available() // sharing + in_use, in_use, f"MemAvailable / {sharing} device(s) + params"


def size_pool(runner, probe_cache, probe_pages: int) -> PoolSize:
    """Sizes the pool for `runner` (params placed, no cache yet). `probe_cache` is a real
    cache of `probe_pages` pages per replica laid out as the pool will be (a multiple of
    mesh.sequence: each device holds probe_pages / N of them): its shard on each device
    gives page_bytes, and the largest bucket compiled against it gives the activation peak."""
    s = runner.config.engine
    devices = [d for d in runner.mesh.devices.flat if d.process_index == jax.process_index()] \
        if runner.mesh is not None else [jax.local_devices()[0]]
    states = cache_states(probe_cache.pages)  # a hybrid's fixed state slots
    state_bytes = max(shard_bytes(states, d) for d in devices)
    sequence = runner.config.mesh.sequence
    if probe_pages % sequence:
        raise ValueError(f"probe_pages={probe_pages} must split over mesh.sequence={sequence}")
    page_bytes = (max(shard_bytes(probe_cache, d) for d in devices) - state_bytes) // (probe_pages // sequence)
    activation = activation_peak(runner, probe_cache)
    best = None
    for d in devices:
        capacity, in_use, source = device_memory(d, runner.state, len(devices))
        in_use += state_bytes  # allocated beside the pages whatever their number
        pages = pool_pages(capacity, in_use, activation, page_bytes, s.memory_utilization, sequence)
        if best is None or pages < best.num_pages:
            best = PoolSize(pages, s.page_size, page_bytes, capacity, in_use, activation,
                            s.memory_utilization, source)
    if devices[0].platform == "cpu" and s.cpu_kv_cache_gb > 0:
        cap = cpu_cap_pages(s.cpu_kv_cache_gb, len(devices), page_bytes, sequence)
        if cap < best.num_pages:
            best = dataclasses.replace(best, num_pages=cap,
                                       source=f"{best.source}, capped by engine.cpu_kv_cache_gb={s.cpu_kv_cache_gb:g}")
    pages = best.num_pages
    if jax.process_count() > 1:  # one cache shape across processes: the smallest decides
        from jax.experimental import multihost_utils

        pages = int(np.min(multihost_utils.process_allgather(np.asarray([pages], np.int64))))
        best = dataclasses.replace(best, num_pages=pages)
    if pages < 2 * sequence:  # the config's rule: at least 2 pages per rank
        raise ValueError(f"engine.num_pages=0: no room for a KV pool ({best.describe()}); lower the weights "
                         "(mesh.tensor, model.weight_dtype), raise engine.memory_utilization or set engine.num_pages")
    if pages - 1 < s.max_pages_per_seq:
        log.warning("%s: fewer than one engine.max_model_len=%d sequence needs", best.describe(), s.max_model_len)
    return best


def activation_peak(runner, probe_cache) -> int:
    """XLA's temp buffer bytes for the largest bucket's step (per device)."""
    shape = max(runner.shapes)
    batch = runner.put(runner.dummy(shape))
    args = (runner.state, probe_cache, batch, runner.prev_tokens)
    key = activation_cache.program_key(runner.config, *args)
    known = activation_cache.remembered(key)
    if known is not None:
        return known
    with runner.mesh_context():
        stats = runner.step_fn.lower(runner.static_graph, *args).compile().memory_analysis()
    peak = int(stats.temp_size_in_bytes) if stats is not None else 0
    activation_cache.remember(key, peak)
    return peak
