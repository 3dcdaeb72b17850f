"""Owns the device state (params, KV cache, mesh) and every device placement.

    host StepBatch (numpy) --device_put--> step.step (jit, cache donated) --> host numpy

Single device by default. With `[mesh]` larger than one device, params and cache are
placed with models/sharding.py (tensor / sequence axes) and batches are replicated;
one data replica for now (engine.num_pages is one pool).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import numpy as np
from flax import nnx

from engine.batch import StepBatch, dummy_batch
from engine.step import step
from models.config import ConfigError
from models.kv_cache import KVCache


@dataclasses.dataclass
class HostOutput:
    tokens: np.ndarray  # [S] i32
    logprob: np.ndarray  # [S] f32
    top_ids: np.ndarray  # [S, N]
    top_logprobs: np.ndarray  # [S, N]


class Runner:
    def __init__(self, config, model, mesh=None):
        self.config = config
        s = config.engine
        self.mesh = mesh  # engine.loading.build_mesh; None = one device
        if self.mesh is not None and self.mesh.shape.get("data", 1) > 1:
            raise ConfigError("the engine runs one data replica for now; set mesh.data = 1")
        self.graphdef, state = nnx.split(model)
        if self.mesh is not None:
            from jax.sharding import NamedSharding, PartitionSpec

            from models.sharding import shard_params

            state = shard_params(state, self.mesh)  # a no-op for params built sharded
            self.batch_sharding = NamedSharding(self.mesh, PartitionSpec())
        else:
            self.batch_sharding = None
        self.state = state
        self.page_size = s.page_size
        self.num_pages = s.num_pages
        self.kv_cache = self.new_cache()

    def new_cache(self) -> KVCache:
        c = self.config
        if self.mesh is not None:
            from models.sharding import create_kv_cache

            return create_kv_cache(c.model, self.mesh, c.engine.num_pages, c.engine.page_size)
        return KVCache.create(c.model, c.engine.num_pages, c.engine.page_size)

    def _context(self):
        if self.mesh is None:
            return contextlib.nullcontext()
        return jax.set_mesh(self.mesh)

    def put(self, batch: StepBatch) -> StepBatch:
        return jax.device_put(batch, self.batch_sharding)

    def run(self, batch: StepBatch) -> HostOutput:
        dev = self.put(batch)
        with self._context():
            out, self.kv_cache = step(self.graphdef, self.state, self.kv_cache, dev)
        tokens, lp, ids, lps = jax.device_get((out.tokens, out.logprob, out.top_ids, out.top_logprobs))
        return HostOutput(np.asarray(tokens), np.asarray(lp), np.asarray(ids), np.asarray(lps))

    def cache_ok(self) -> bool:
        return not any(p.is_deleted() for p in self.kv_cache.pages)

    def reset_cache(self) -> None:
        """After a failed step the donated cache may be gone: start from a fresh one."""
        self.kv_cache = self.new_cache()

    def warmup(self, shapes, max_pages: int, penalty_window: int, progress: bool = True) -> None:
        """Compiles (and runs once) every bucket; an all-padding batch writes nothing."""
        it = shapes
        if progress:
            from tqdm import tqdm

            it = tqdm(shapes, desc="compiling buckets", unit="bucket")
        for shape in it:
            self.run(dummy_batch(shape, max_pages, penalty_window))

    @staticmethod
    def cache_size() -> int:
        """Compiled programs held by the step jit (tests: no growth after warm-up)."""
        return step._cache_size()
