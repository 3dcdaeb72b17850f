"""What an engine is made of, built from a Config in the one order that works: the CPU
split and the compile cache before jax starts, the mesh (jax.distributed) before any other
device query, the model into the mesh's shards, the runner (which sizes the KV pool), the
host KV tier around the runner's cache, then the scheduler and request factory over them.

EngineCore (engine/core.py) takes these parts as they are, so the step logic never
needs to know how a model was loaded.
"""

from __future__ import annotations

import dataclasses

from jaxfill.engine.batch import bucket_shapes
from jaxfill.engine.compile_cache import use_compile_cache
from jaxfill.engine.config import Config
from jaxfill.engine.cpu_devices import use_cpu_cores
from jaxfill.engine.kv_tier.page_offload import build_kv_offload
from jaxfill.engine.loading import build_mesh, build_model, build_tokenizer
from jaxfill.engine.lora.slots import LoraSlots
from jaxfill.engine.mesh import with_mesh_shape
from jaxfill.engine.request_factory import RequestFactory
from jaxfill.engine.runner import Runner
from jaxfill.engine.scheduler import ReplicaScheduler
from jaxfill.engine.tokenizer import IdsOnlyTokenizer
from jaxfill.engine.vision.loading import build_vision


@dataclasses.dataclass
class Parts:
    config: Config  # as the runner resolved it (engine.num_pages = 0 sized, a CPU split's mesh.tensor)
    runner: Runner  # params, KV cache, mesh, compiled steps (and the host KV tier: runner.kv_offload)
    scheduler: ReplicaScheduler  # one per mesh.data replica
    factory: RequestFactory  # prompt checks, ids, seeds; holds the tokenizer
    shapes: list[tuple[int, int]]  # the (tokens, seqs) buckets the warm-up compiles
    lora: LoraSlots | None = None  # adapters and their device slots (engine/lora/); None: lora.max_loras = 0


def assemble(config: Config, model=None, progress: bool = True, compile_cache: str | None = "default") -> Parts:
    """`model`: an already built model for this config (tests share one); None loads it.
    `compile_cache` as Engine takes it (engine/compile_cache.py)."""
    use_cpu_cores(config.mesh, config.model.dtype)  # first: one XLA CPU device per core, before jax starts
    use_compile_cache(compile_cache)
    try:
        tokenizer = build_tokenizer(config)
    except ValueError as e:  # a checkpoint without a tokenizer still serves token ids
        tokenizer = IdsOnlyTokenizer(str(e))
    mesh = build_mesh(config)
    config = with_mesh_shape(config, mesh)  # a CPU split's mesh.tensor
    if model is None:
        model = build_model(config, mesh, progress=progress)
    if config.lora.enabled:  # a copy with zero slot tables beside the targeted projections (models/lora.py)
        from jaxfill.models.lora import attach_tables

        model = attach_tables(model, config.lora.max_loras, config.lora.max_lora_rank)
    shapes = bucket_shapes(config.engine, multiple_of=config.mesh.sequence)
    runner = Runner(config, model, mesh, shapes)
    config = runner.config  # engine.num_pages = 0 is resolved there
    s = config.engine
    # engine.host_kv_cache_gb > 0: evicted prefix pages kept in host memory (and on disk)
    runner.kv_offload = offload = build_kv_offload(config, runner.kv_cache, runner.stages)
    scheduler = ReplicaScheduler(s, runner.num_replicas, tier=offload and offload.tier,
                                 on_evict=offload and offload.on_evict, page_ranks=config.mesh.sequence,
                                 speculative=config.speculative)
    runner.vision = build_vision(config)
    lora = None
    if config.lora.enabled:
        lora = LoraSlots(config.lora, runner)
        lora.warm()
    factory = RequestFactory(config, tokenizer, scheduler.requests, vision=runner.vision)
    return Parts(config, runner, scheduler, factory, shapes, lora)
