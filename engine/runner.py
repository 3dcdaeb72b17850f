"""Owns the device state (params, KV cache, mesh) and every device placement.

    host StepBatch (numpy) --device_put--> step.step (jit, cache donated) --> host numpy

Single device by default. With `[mesh]` larger than one device, params and cache are
placed with models/sharding.py. With mesh.data = R > 1 the batch holds R replicas'
batches stacked [R, ...], split over 'data', and runs through step.step_replicas; the
cache's page axis holds R pools of engine.num_pages pages.

Multi-process (jax.distributed): process 0 broadcasts every batch before running it and
the other processes run it from `follow()` (engine/lockstep.py), so all run the same
jitted programs in the same order.

Warm-up first checks the attention impl the model was built with (unless `xla` or the
`reference` oracle) against `xla` on a small mixed batch at the model's head shapes
(pallas_kernels/ragged_paged_attention/self_check.py); if it fails to lower or disagrees, one warning, and the engine serves
with `xla` (`attention_impl` says which impl serves, `attention_check` why). Process 0
decides and tells the followers, so every process compiles the same program.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import traceback

import jax
import numpy as np
from flax import nnx

from jaxfill.engine.batch import StepBatch, dummy_batch, stack_batches
from jaxfill.engine.expert_load import ExpertLoad
from jaxfill.engine.pending_output import HostOutput, PendingOutput
from jaxfill.engine.lockstep import (HEARTBEAT, KV_EXPORT, KV_IMPORT, KV_RESTORE, KV_SAVE, KV_WARMUP, RESET, RUN, STOP,
                                    USE_XLA, WEIGHT_OPS, Lockstep)
from jaxfill.engine.disagg.runner_side import RunnerDisagg
from jaxfill.engine.kv_tier.runner_side import RunnerKVTier
from jaxfill.engine.speculative.mtp_step import step_mtp
from jaxfill.engine.speculative.verify_rows import padding_rows
from jaxfill.engine import executable_cache
from jaxfill.engine.step import StaticGraph, step, step_replicas
from jaxfill.models.kv_cache import KVCache
from jaxfill.models.quant import param_bytes
from jaxfill.models.vision.rows import VisionRows
from jaxfill.pallas_kernels import resolve_impl

log = logging.getLogger("jaxfill.runner")


class Runner(RunnerKVTier, RunnerDisagg):
    def __init__(self, config, model, mesh=None, shapes=()):
        self.config = config
        s = config.engine
        self.mesh = mesh  # engine.loading.build_mesh; None = one device
        self.num_replicas = int(mesh.shape.get("data", 1)) if mesh is not None else 1
        self.stages = model.stages  # > 1: the pipelined layout (models/parallel/pipeline.py)
        self.graphdef, state = nnx.split(model)
        if self.mesh is not None:
            from jax.sharding import NamedSharding, PartitionSpec

            from jaxfill.models.sharding import DATA, shard_params

            state = shard_params(state, self.mesh)  # a no-op for params built sharded
            spec = PartitionSpec(DATA) if self.num_replicas > 1 else PartitionSpec()
            self.batch_sharding = NamedSharding(self.mesh, spec)
        else:
            self.batch_sharding = None
        self.mtp = config.model.run_mtp  # every step runs the MTP proposer too (engine/speculative/mtp_step.py)
        self.step_fn = step_mtp if self.mtp else step_replicas if self.num_replicas > 1 else step  # the jitted step
        self.vision = None  # the vision tower (engine/vision/tower.py) of a model that reads images
        self.state = state
        self.attention_impl = resolve_impl(model.attention_impl)  # the impl that serves
        self.attention_check = "not checked yet (warmup checks it)"
        # Engine.warmup(buckets=False): say so when a step first needs a bucket (it compiles then)
        self.announce_new_shapes = False
        self._announced: set[tuple[int, int]] = set()
        self.page_size = s.page_size
        # rows of a step's prompt_logprobs scoring (the scheduler's cap; one static size)
        self.prompt_rows = min(s.prompt_logprobs_rows, s.max_num_batched_tokens)
        # rows a step may verify proposals on (engine/speculative/verify_rows.py); 0 = off
        spec = config.speculative
        self.verify_rows = s.max_num_seqs * spec.num_tokens if spec.enabled else 0
        # pooling requests (engine/pooling/) run the step's pooling variant; a model without an
        # LM head (an embedding backbone) runs only that one
        self.pooling = config.model.pooling.enabled
        self.has_head = model.has_head
        self.shapes = list(shapes)
        self.prev_tokens = self._no_prev_tokens()  # [R * max_num_seqs] the last step's tokens
        self.pool = None  # engine.memory.PoolSize when engine.num_pages = 0 sized the pool
        if s.num_pages == 0:
            self._size_pool()
        self.num_pages = self.config.engine.num_pages
        self.kv_cache = self.new_cache()
        # Fixed at build (a fresh cache has the same shapes): stats() reads these from any
        # thread, never the arrays themselves, which every step donates.
        self.kv_sizes = self.kv_cache.sizes()
        self.weight_bytes = param_bytes(self.state)
        m = config.model
        self.expert_load = ExpertLoad(m.num_layers, m.moe.num_experts, self.stages) if m.moe.num_experts else None
        self.kv_offload = None  # engine/kv_tier/page_offload.py when engine.host_kv_cache_gb > 0 (Engine sets it)
        self.lockstep = None
        if jax.process_count() > 1:
            self.lockstep = Lockstep([self.dummy(shape) for shape in self.shapes])

    graphdef = property(lambda self: self._graphdef, doc="the model structure (nnx.split's graphdef)")

    @graphdef.setter
    def graphdef(self, graphdef) -> None:  # and the steps' static argument, hashed once (engine/step.py)
        self._graphdef, self.static_graph = graphdef, StaticGraph(graphdef)
        self._programs = None  # a new structure: new programs

    @property
    def programs(self):
        """The step programs kept on disk under a key that needs no tracing
        (engine/executable_cache.py), or the jitted step itself when that cache is off."""
        if self._programs is None:
            self._programs = (executable_cache.StepPrograms(self.step_fn, self.config, self.attention_impl)
                              if executable_cache.enabled() else self.step_fn)
        return self._programs

    @property
    def is_leader(self) -> bool:
        return self.lockstep is None or self.lockstep.is_leader

    def new_cache(self, num_pages: int | None = None) -> KVCache:
        c = self.config
        num_pages = num_pages or c.engine.num_pages
        cache = KVCache.create(c.model, num_pages, c.engine.page_size, fill_value=float(c.engine.kv_fill_value),
                               kv_cache_dtype=c.engine.kv_cache_dtype, stages=self.stages, mesh=self.mesh,
                               state_slots=c.engine.state_pool_slots)
        if self.mesh is not None:
            return cache  # allocated in its shards
        # Committed, as the step returns it: an uncommitted first cache compiles the first
        # warm-up bucket a second time once the step's committed output comes back.
        return jax.device_put(cache, jax.devices()[0])

    def _size_pool(self) -> None:
        """engine.num_pages = 0: as many pages as fit (engine/memory.py); self.config then
        carries the number, which the engine's scheduler and checks read."""
        from jaxfill.engine.memory import size_pool

        probe_pages = 2 * self.config.mesh.sequence  # two pages on each rank the pool is dealt over
        probe = self.new_cache(probe_pages)
        self.pool = size_pool(self, probe, probe_pages)
        del probe
        engine = dataclasses.replace(self.config.engine, num_pages=self.pool.num_pages)
        self.config = dataclasses.replace(self.config, engine=engine)
        log.info("%s", self.pool.describe())

    def _no_prev_tokens(self) -> jax.Array:
        """The step's `prev_tokens` before any step ran, placed as the step returns it."""
        n = self.num_replicas * self.config.engine.max_num_seqs
        if self.mesh is None:
            return jax.device_put(np.zeros(n, np.int32), jax.devices()[0])
        from jax.sharding import NamedSharding, PartitionSpec

        zeros = np.zeros(n, np.int32)
        return jax.make_array_from_callback((n,), NamedSharding(self.mesh, PartitionSpec()), lambda i: zeros[i])

    def dummy(self, shape: tuple[int, int], verify: bool = False, pool: bool = False) -> StepBatch:
        """An all-padding batch of one bucket (warm-up, and what followers receive into);
        `verify`: with padding verification rows (speculative decoding's program); `pool`:
        the pooling program's."""
        s = self.config.engine
        one = dummy_batch(shape, s.max_pages_per_seq, s.penalty_window, self.config.model.vocab_size,
                          self.prompt_rows, s.state_slots > 0, pool, self.config.lora.enabled, self.verify_rows,
                          self.mtp)
        if verify:
            one = dataclasses.replace(one, verify=padding_rows(self.verify_rows, s.penalty_window,
                                                               self.config.model.vocab_size))
        if self.config.model.attention.mrope_section:  # every step of such a model carries its positions
            one = dataclasses.replace(one, vision=VisionRows(np.zeros((3, shape[0]), np.int32)))
        return stack_batches([one] * self.num_replicas)

    def mesh_context(self):
        """Where the step runs: inside the mesh (jax.set_mesh), or nothing for one device."""
        if self.mesh is None:
            return contextlib.nullcontext()
        return jax.set_mesh(self.mesh)

    def put(self, batch: StepBatch) -> StepBatch:
        return jax.device_put(batch, self.batch_sharding)

    # ------------------------------------------------------------------ steps
    def run(self, batch: StepBatch) -> PendingOutput:
        """Dispatches one step; returns before it finishes (`.get()` waits)."""
        self.save_evicted()  # before RUN: followers dispatch the same programs in the same order
        if self.lockstep is not None:
            self.lockstep.send(RUN, batch)
        return self._launch(batch)

    def _launch(self, batch: StepBatch) -> PendingOutput:
        scores_prompt = bool((np.asarray(batch.lp_rows) >= 0).any())  # the other program (engine/step.py)
        if self.announce_new_shapes and batch.shape not in self._announced:
            self._announced.add(batch.shape)
            print(f"jaxfill: step bucket {batch.shape[0]}x{batch.shape[1]} (compiled, or loaded from the compile "
                  "cache, on first use)", file=sys.stderr, flush=True)
        dev = self.put(batch)
        self.save_evicted()
        if self.kv_offload is not None:
            self.kv_offload.sync()
        with self.mesh_context():
            out, self.kv_cache, self.prev_tokens = self.programs(self.static_graph, self.state, self.kv_cache, dev,
                                                                 self.prev_tokens, scores_prompt)
            if self.expert_load is not None:
                self.expert_load.snapshot(self.kv_cache)
        return PendingOutput(out)

    def _execute(self, batch: StepBatch) -> HostOutput:
        return self._launch(batch).get()

    def copy_states(self, first: list[tuple[int, int]], then: list[tuple[int, int]]) -> None:
        """Linear-attention state slots copied (src, dst), `first` before `then` (state
        snapshots taken, then restored: engine/scheduler/state_snapshots.py). One process
        (hybrids refuse several); pairs pad to a power of two, so few programs."""
        from jaxfill.models.linear_state import copy_state_slots

        null = self.config.engine.state_pool_slots - 1
        size = 1 << (max(len(first), len(then), 1) - 1).bit_length()
        pad = lambda pairs: np.asarray(list(pairs) + [(null, null)] * (size - len(pairs)), np.int32).T  # noqa: E731
        (fs, fd), (ts, td) = pad(first), pad(then)
        with self.mesh_context():
            self.kv_cache = copy_state_slots(self.kv_cache, fs, fd, ts, td)

    def export_state(self, slot: int) -> list:
        """A hybrid's state slot as one-device arrays, for a disaggregated pull."""
        from jaxfill.engine import kv_rows

        with self.mesh_context():
            return kv_rows.export_state(self.kv_cache, slot)

    def import_state(self, arrays: list, slot: int) -> None:
        """A pulled state written into `slot` (the cache is donated and replaced)."""
        from jaxfill.engine import kv_rows

        with self.mesh_context():
            self.kv_cache = kv_rows.import_state(self.kv_cache, arrays, slot)

    def cache_ok(self) -> bool:
        return not any(a.is_deleted() for a in self.kv_cache.arrays())

    def reset_cache(self) -> None:
        """After a failed step the donated cache may be gone: start from a fresh one
        (a collective allocation: followers are told to do the same)."""
        if self.lockstep is not None:
            self.lockstep.send(RESET)
        if self.kv_offload is not None:
            self.kv_offload.drop_queued()
        self.kv_cache = self.fresh_cache()

    def fresh_cache(self) -> KVCache:
        """A new cache in place of the current one (its expert counters start at 0)."""
        if self.expert_load is not None:
            self.expert_load.reset()
        return self.new_cache()

    def expert_totals(self, refresh: bool = False) -> dict:
        """layer -> [E] int64 (token, expert) pairs routed so far ({} for a dense model).
        `refresh` copies the counters now and waits for them (one process only: in a
        multi-host run every process must dispatch the same programs)."""
        if self.expert_load is None:
            return {}
        if refresh:
            if self.lockstep is not None:
                raise RuntimeError("expert_totals(refresh=True) is for a single-process engine")
            self.expert_load.snapshot(self.kv_cache, force=True)
        return self.expert_load.totals(wait=refresh)

    def warmup(self, progress: bool = True) -> tuple[int, int]:
        """Checks the attention impl, then compiles or loads from the persistent compile
        cache (and runs once) every bucket; an all-padding batch writes nothing. Returns
        (programs loaded from a cache, programs compiled)."""
        from jaxfill.engine.compile_cache import count_cache_hits

        self.check_attention_impl()
        it = self.shapes
        if progress:
            from jaxfill.models.progress import progress_bar

            it = progress_bar(self.shapes, desc="step programs", unit="bucket")
        kept = self.programs if isinstance(self.programs, executable_cache.StepPrograms) else None
        kept_hits = kept.hits if kept else 0
        with count_cache_hits() as counts:
            for shape in it:
                if self.has_head:
                    self.run(self.dummy(shape)).get()
                if self.pooling:  # Engine.embed / score's program, so no pooling request waits for one
                    self.run(self.dummy(shape, pool=True)).get()
                if self.verify_rows:  # speculative decoding's programs too, so no request waits for one
                    self.run(self.dummy(shape, verify=True)).get()
            if self.kv_offload is not None:  # the host tier's gathers and scatters
                if self.lockstep is not None:
                    self.lockstep.send(KV_WARMUP)
                self._warm_kv_offload()
        # a program loaded from engine/executable_cache.py never reaches jax's cache; one it
        # compiles does, and jax counts that
        loaded = counts["hits"] + (kept.hits - kept_hits if kept else 0)
        return loaded, counts["requests"] - counts["hits"]

    def check_attention_impl(self) -> None:
        """Leader: a non-xla impl must lower and match xla here, or xla serves instead. The
        reference impl is not checked: it is the oracle xla itself is tested against
        (tests/test_attention_oracle.py), and checking it would compile xla for nothing."""
        if self.attention_impl in ("xla", "reference"):
            self.attention_check = f"{self.attention_impl} is a baseline (nothing to check)"
            return
        from jaxfill.pallas_kernels.ragged_paged_attention.self_check import check_impl

        m = self.config.model
        kv_heads = min(m.num_kv_heads, 2)  # per-head work; keeps the query group size
        error = check_impl(self.attention_impl, num_q_heads=kv_heads * (m.num_heads // m.num_kv_heads),
                           num_kv_heads=kv_heads, head_dim=m.head_dim, page_size=self.page_size,
                           dtype=m.jnp_dtype, sliding_window=m.attention.sliding_window,
                           attention_chunk=m.attention.attention_chunk,
                           kv_cache_dtype=self.config.engine.kv_cache_dtype)
        if error is None:
            self.attention_check = f"{self.attention_impl} matches xla on a mixed batch"
            return
        log.warning("attention impl %r failed its warm-up check against xla (%s); serving with xla",
                    self.attention_impl, error)
        self.attention_check = f"{self.attention_impl} failed ({error}); xla serves"
        if self.lockstep is not None:
            self.lockstep.send(USE_XLA)
        self._use_xla()

    def _use_xla(self) -> None:
        """Rebuilds the graphdef (which holds the impl name) around the same params."""
        model = nnx.merge(self.graphdef, self.state)
        model.attention_impl = "xla"
        self.graphdef, self.state = nnx.split(model)
        self.attention_impl = "xla"

    # ------------------------------------------------------------------ multi-process
    def idle(self) -> None:
        """Leader, nothing to run: keeps the followers' wait shorter than collective timeouts."""
        if self.lockstep is not None and self.lockstep.is_leader:
            self.lockstep.heartbeat()

    def close(self) -> None:
        """Leader: releases the followers (their follow() returns), and waits for the host
        tier's saves and disk writes to land. Idempotent."""
        if self.kv_offload is not None:
            self.kv_offload.flush()
        if self.lockstep is not None and self.lockstep.is_leader and not self.lockstep.stopped:
            self.lockstep.send(STOP)

    def follow(self) -> int:
        """Follower: runs the leader's batches until it closes; returns the steps run."""
        if self.is_leader:
            raise RuntimeError("follow() is for processes other than 0 of a multi-process run")
        steps = 0
        while True:
            op, batch = self.lockstep.receive()
            if op == STOP:
                return steps
            if op == RESET:
                self.kv_cache = self.fresh_cache()
            elif op == USE_XLA:
                self._use_xla()
                self.attention_check = "process 0's warm-up check failed; xla serves"
            elif op == RUN:
                try:
                    self._execute(batch)
                    steps += 1
                except Exception:  # noqa: BLE001 - the leader sees the same failure and decides
                    log.error("step failed on this follower:\n%s", traceback.format_exc())
            elif op in (KV_SAVE, KV_RESTORE):
                self._follow_kv(op, batch)
            elif op in (KV_EXPORT, KV_IMPORT):  # disaggregated prefill (engine/disagg/runner_side.py)
                self._follow_disagg(op, batch)
            elif op == KV_WARMUP:
                self._warm_kv_offload()
            elif op in WEIGHT_OPS:  # Engine.update_weights / sleep / wake on process 0
                from jaxfill.engine import weights_lockstep

                weights_lockstep.follow(self, op, batch)
            elif op != HEARTBEAT:
                raise RuntimeError(f"unknown lockstep op {op} from process 0")

    def cache_size(self) -> int:
        """Compiled programs held by the step jits and this runner's kept executables (tests:
        no growth after warm-up)."""
        from jaxfill.engine.kv_tier.page_offload import KVOffload

        kept = len(self._programs) if isinstance(self._programs, executable_cache.StepPrograms) else 0
        return (step._cache_size() + step_replicas._cache_size() + step_mtp._cache_size() + KVOffload.cache_size()
                + kept)
