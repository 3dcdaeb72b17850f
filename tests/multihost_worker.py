"""One process of the two-process test (tests/test_multihost.py): 4 CPU devices each,
jax.distributed over 127.0.0.1, one 8-device mesh, the same jitted steps in lockstep.

    python tests/multihost_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_JSON

Runs (1) a model-level greedy loop (chunked prefill + decode with the sharded forward),
(2) the Engine on tensor 2 x sequence 4, process 0 generating and process 1 following,
(3) the same with two data replicas (one per process) x tensor 2 x sequence 2, (4) int8,
(5) a mixture of experts, (6) the host KV tier (each process its own).
Writes {"model": [...], "engine": {...}, "engine_dp": {...}, ...} (an "error" key on failure).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TENSOR, SEQUENCE = 2, 4
CHUNK = 16
MODEL = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=8,
             num_kv_heads=2, head_dim=16, max_position_embeddings=4096, seed=3)
PROMPT = [(37 * i + 11) % 500 for i in range(37)]
PROMPT2 = [(53 * i + 5) % 500 for i in range(21)]
MAX_TOKENS = 10
QUANT = {"engine.kv_cache_dtype": "int8", "model.weight_dtype": "int8"}  # quantized weights and KV
# the host KV tier: a 16-page pool (4 per sequence rank) that evicts each document before it is asked again
TIER = {"engine.num_pages": 16, "engine.host_kv_cache_gb": 0.001, "engine.kv_fill_value": float("nan")}
TIER_DOCS = [[(71 * i + 13 * j + 3) % 500 for j in range(32)] for i in range(3)]
TIER_PROMPTS = [doc + [k] for k, doc in enumerate(TIER_DOCS * 2)]
# a mixture of experts split over 'expert' = 4 across the two processes (x tensor 2)
MOE = {"model.num_experts": 8, "model.experts_per_token": 2, "model.moe_intermediate_size": 64, "mesh.expert": 4}
# multi-head latent attention (DeepSeek V3's layer, random init): heads over tensor (across
# the processes), the one latent head on every device, rows over sequence
MLA = {"model.architecture": "DeepseekV3ForCausalLM", "model.kv_lora_rank": 32, "model.qk_rope_head_dim": 16,
       "model.qk_nope_head_dim": 16, "model.v_head_dim": 16, "model.num_kv_heads": 1, "model.head_dim": 48,
       "model.rotary_dim": 16, "model.rope_interleave": True}


def model_config():
    from jaxfill.models.config import ModelConfig

    return ModelConfig.of(**MODEL)


def reference_tokens(prompt=PROMPT) -> list[int]:
    """Single process, one device: engine/simple.py's loop (the ground truth)."""
    import jax
    from flax import nnx

    from jaxfill.engine.simple import generate_one
    from jaxfill.engine import placement
    from jaxfill.models.kv_cache import KVCache
    from jaxfill.models.decoder import Decoder

    cfg = model_config()
    graphdef, _ = placement.abstract_state(cfg)
    state = jax.jit(lambda: nnx.split(Decoder(cfg, nnx.Rngs(cfg.seed)))[1])()
    tokens, _ = generate_one(nnx.merge(graphdef, state), prompt, KVCache.create(cfg, 16, 8), MAX_TOKENS, chunk=CHUNK)
    return tokens


def sharded_greedy(mesh) -> list[int]:
    """Model-level greedy loop; every input is a global (replicated) array, the argmax is
    replicated so each process reads it from its own devices."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxfill.engine.simple import bucket
    from jaxfill.engine import placement
    from jaxfill.models.forward import forward
    from jaxfill.models.kv_cache import KVCache, dealt_pages, single_sequence_metadata

    cfg = model_config()
    graphdef, state = placement.init_sharded(cfg, mesh)
    cache = KVCache.create(cfg, 16, 8, mesh=mesh)
    replicated = NamedSharding(mesh, P())

    def put(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, replicated, lambda idx: x[idx])

    pick = jax.jit(lambda logits: jnp.argmax(logits[0]).astype(jnp.int32), out_shardings=replicated)
    pages = dealt_pages(7, 16, cache.page_ranks)  # context parallel: page j on sequence rank j mod N
    seq = list(PROMPT)
    out: list[int] = []
    pos = 0
    while len(out) < MAX_TOKENS:
        while pos < len(seq):
            n = min(CHUNK, len(seq) - pos)
            padded = bucket(n)
            tokens = np.zeros(padded, np.int32)
            tokens[:n] = seq[pos:pos + n]
            positions = np.zeros(padded, np.int32)
            positions[:n] = np.arange(pos, pos + n)
            meta = jax.tree.map(put, single_sequence_metadata(n, pos, pages, 8, pad_to=padded))
            with jax.set_mesh(mesh):
                logits, cache = forward(graphdef, state, put(tokens), put(positions), cache, meta)
            pos += n
        token = int(np.asarray(pick(logits).addressable_data(0)))
        out.append(token)
        seq.append(token)
    return out


def engine_run(settings, mesh_shape: tuple[int, int, int], prompts: list[list[int]],
               extra: dict | None = None) -> dict:  # extra: overrides, mesh.expert included
    """Engine on a (data, tensor, sequence) mesh over both processes: process 0 schedules
    and generates, process 1 follows its broadcast batches. Params come in already
    sharded (init_sharded), so no process ever builds the whole model on one device."""
    from flax import nnx

    from jaxfill.engine.config import MeshSettings, load_config
    from jaxfill.engine.engine import Engine
    from jaxfill.engine.mesh import make_mesh
    from jaxfill.engine.request import SamplingParams
    from jaxfill.engine import placement

    data, tensor, sequence = mesh_shape
    overrides = {f"model.{k}": v for k, v in MODEL.items()}
    overrides.update({
        "mesh.data": data, "mesh.tensor": tensor, "mesh.sequence": sequence,
        "mesh.coordinator": settings.coordinator, "mesh.num_processes": settings.num_processes,
        "mesh.process_id": settings.process_id,
        "engine.page_size": 8, "engine.num_pages": 64, "engine.max_model_len": 256,
        "engine.max_num_seqs": 1, "engine.max_num_batched_tokens": CHUNK,
        "engine.token_buckets": [CHUNK], "engine.seq_buckets": [1],
        "engine.attention_impl": "reference",  # tests/fast_engine.py
        **(extra or {}),
    })
    config = load_config("tiny_random", overrides)
    mesh = make_mesh(MeshSettings(data=data, tensor=tensor, sequence=sequence, expert=config.mesh.expert))
    graphdef, state = placement.init_sharded(config.model, mesh, config.engine.attention_impl)
    with Engine(config, progress=False, model=nnx.merge(graphdef, state)) as engine:
        if not engine.is_leader:
            try:
                engine.add_request(PROMPT)
                refused = None
            except RuntimeError as e:  # the scheduler lives on process 0 only
                refused = str(e)
            return {"steps_run": engine.follow(), "refused": refused}
        engine.runner.lockstep.last_sent -= 3600  # long idle: the next idle() sends a heartbeat
        engine.idle()
        completions = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                              ignore_eos=True))
        stats = engine.stats()
        return {"tokens": [list(c.token_ids) for c in completions], "cached": [c.cached_tokens for c in completions],
                "host_kv_hit_tokens": stats["host_kv_hit_tokens"],
                "steps_run": engine.num_steps + len(engine.shapes),  # + one warm-up step per bucket
                "per_replica": stats["requests_per_replica"], "free": stats["pages_free"],
                "total": stats["pages_total"]}


def tier_reference_tokens() -> list[list[int]]:
    """TIER_PROMPTS on one device in one process, no host tier: what the tiered run must give."""
    from jaxfill.engine.config import load_config
    from jaxfill.engine.engine import Engine
    from jaxfill.engine.request import SamplingParams

    overrides = {f"model.{k}": v for k, v in MODEL.items()}
    overrides.update({"engine.page_size": 8, "engine.num_pages": 64, "engine.max_model_len": 256,
                      "engine.max_num_seqs": 1, "engine.max_num_batched_tokens": CHUNK,
                      "engine.token_buckets": [CHUNK], "engine.seq_buckets": [1]})
    engine = Engine(load_config("tiny_random", overrides), progress=False)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [list(c.token_ids) for c in engine.generate(TIER_PROMPTS, params)]


def quant_reference_tokens(extra: dict | None = None) -> list[int]:
    """The int8-weights, int8-KV engine (or `extra`'s, mesh.* dropped) on one device in one
    process: what the multi-process run must reproduce."""
    from jaxfill.engine.config import load_config
    from jaxfill.engine.engine import Engine
    from jaxfill.engine.request import SamplingParams

    overrides = {f"model.{k}": v for k, v in MODEL.items()}
    overrides.update({"engine.page_size": 8, "engine.num_pages": 64, "engine.max_model_len": 256,
                      "engine.max_num_seqs": 1, "engine.max_num_batched_tokens": CHUNK,
                      "engine.token_buckets": [CHUNK], "engine.seq_buckets": [1],
                      **{k: v for k, v in (QUANT if extra is None else extra).items() if not k.startswith("mesh.")}})
    engine = Engine(load_config("tiny_random", overrides), progress=False)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return list(engine.generate([PROMPT], params)[0].token_ids)


def main():
    process_id, num_processes, port, out_path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    from jaxfill.engine.config import MeshSettings
    from jaxfill.engine.mesh import initialize_distributed, make_mesh

    settings = MeshSettings(tensor=TENSOR, sequence=SEQUENCE, coordinator=f"127.0.0.1:{port}",
                            num_processes=num_processes, process_id=process_id)
    initialize_distributed(settings)
    import jax

    result = {"process_index": jax.process_index(), "process_count": jax.process_count(),
              "global_devices": len(jax.devices()), "local_devices": len(jax.local_devices()),
              "device_ids": sorted(d.id for d in jax.devices())}
    mesh = make_mesh(settings)
    result["model"] = sharded_greedy(mesh)
    for name, shape, prompts, extra in (("engine", (1, TENSOR, SEQUENCE), [PROMPT], None),
                                        ("engine_dp", (2, 2, 2), [PROMPT, PROMPT2], None),
                                        ("engine_quant", (1, TENSOR, SEQUENCE), [PROMPT], QUANT),
                                        ("engine_moe", (1, TENSOR, 1), [PROMPT], MOE),
                                        ("engine_mla", (1, TENSOR, SEQUENCE), [PROMPT], MLA),
                                        ("engine_tier", (1, TENSOR, SEQUENCE), TIER_PROMPTS, TIER)):
        try:
            result[name] = engine_run(settings, shape, prompts, extra)
        except Exception:  # noqa: BLE001 - reported, the test decides
            result[name] = {"error": traceback.format_exc()[-4000:]}
    with open(out_path, "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
