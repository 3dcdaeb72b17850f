"""Per-expert token counts of a MoE model, read from the device without stalling a step.

Every forward adds its (token, expert) pairs to counters kept in the KV cache
(models/kv_cache.py `expert_tokens`). The cache is donated to the next step, so the host
never reads it directly: every `interval_steps` steps the runner dispatches a copy of the
counters right behind the step just launched and starts its transfer to the host
(`snapshot`; counted in steps, not time, so every process of a multi-host run dispatches
the same programs); `totals()` folds in the newest copy that has arrived and never waits on one
still in flight. The device counters are int32 and wrap; the host adds the differences
mod 2**32 into int64 totals, so only a gap of 2**32 pairs per expert between two reads
could be lost. A fresh cache (engine reset) restarts the device counters at 0.

In a multi-host run each process sums the data replicas it holds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


@jax.jit
def _copy(counters: tuple) -> tuple:
    return jax.tree.map(jnp.copy, counters)


def _local(a: jax.Array) -> np.ndarray:  # the global shape; other processes' shards left 0
    if a.is_fully_addressable:
        return np.asarray(a)
    out = np.zeros(a.shape, a.dtype)
    for shard in a.addressable_shards:
        out[shard.index] = np.asarray(shard.data)
    return out


class ExpertLoad:
    def __init__(self, num_layers: int, num_experts: int, stages: int, interval_steps: int = 8):
        self.num_layers, self.num_experts, self.stages = num_layers, num_experts, stages
        self.interval_steps = interval_steps
        self.totals_ = {}  # layer -> [E] int64
        self._last = {}  # layer -> [E] uint32, the device counter at the last fold
        self._pending = None  # a copy of the counters on its way to the host
        self._steps = 0
        self._summary = None  # summary(totals) since the last fold (stats() reads it every step)

    def snapshot(self, cache, force: bool = False) -> None:
        """Right after a step's dispatch: copies the counters (async) when one is due."""
        self._steps += 1
        if cache.expert_tokens is None or not (force or self._steps % self.interval_steps == 0):
            return
        self._pending = _copy(cache.expert_tokens)
        for a in jax.tree.leaves(self._pending):
            a.copy_to_host_async()

    def reset(self) -> None:
        """The cache was replaced by a fresh one: its counters start again at 0."""
        self._pending = None
        self._last = {}

    def totals(self, wait: bool = False) -> dict[int, np.ndarray]:
        """layer -> [E] int64 pairs routed to each expert so far (the newest arrived copy;
        `wait`: the one in flight too)."""
        pending = self._pending
        if pending is not None and (wait or self._pending_ready()):
            self._pending = None
            self._summary = None
            self._fold(pending)
        return {layer: t.copy() for layer, t in sorted(self.totals_.items())}

    def summary(self) -> dict:
        """summary() of the totals, rebuilt only when a copy was folded in: the same dict
        object until then, so a reader can tell nothing changed (serving/metrics.py)."""
        if self._summary is None or self._pending_ready():
            self._summary = summary(self.totals())
        return self._summary

    def _pending_ready(self) -> bool:
        pending = self._pending
        return pending is not None and all(a.is_ready() for a in jax.tree.leaves(pending))

    def _fold(self, counters: tuple) -> None:
        per_entry = self.num_layers // self.stages
        for j, counter in enumerate(counters):
            if counter is None:
                continue
            rows = _local(counter).reshape(self.stages, -1, self.num_experts)  # [p, R, E]
            for s in range(self.stages):
                layer = s * per_entry + j
                now = rows[s].astype(np.uint32).sum(axis=0, dtype=np.uint32)  # replicas summed, mod 2**32
                last = self._last.get(layer, np.zeros(self.num_experts, np.uint32))
                delta = (now - last).astype(np.uint32)  # wraps like the device counter
                self.totals_[layer] = self.totals_.get(layer, np.zeros(self.num_experts, np.int64)) + delta
                self._last[layer] = now


def summary(totals: dict[int, np.ndarray]) -> dict:
    """What Engine.stats() reports: per MoE layer the pairs each expert got, and the load
    imbalance (busiest expert over the mean) of the worst layer."""
    worst = max((float(t.max() * len(t) / t.sum()) for t in totals.values() if t.sum()), default=0.0)
    return {"moe_expert_tokens": {layer: t.tolist() for layer, t in totals.items()},
            "moe_load_imbalance": worst}


# Histogram buckets of an expert's share of its layer's pairs over an interval, in units of
# the mean (1.0 = perfectly balanced; serving/metrics.py)
LOAD_RATIO_BUCKETS = (0.0, 0.25, 0.5, 0.75, 0.9, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0, 8.0)
