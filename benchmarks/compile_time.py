"""Cold start: compile time of the engine's real step program, layers unrolled vs
`engine.scan_layers` (one lax.scan over params and a cache stacked [L, ...]).

Two measurements, both with the persistent compile cache off:

* per bucket: `jax.jit(engine.step.step.__wrapped__)` lowered and compiled after
  `jax.clear_caches()`, for `Decoder(m)` vs `Decoder(m, plan=ExecutionPlan.stacked(L))`, on abstract
  state (`nnx.eval_shape`), an abstract cache (`jax.eval_shape(KVCache.create)`), an
  abstract `dummy_batch` and abstract prev_tokens: nothing is allocated, so the 8B and
  80-layer shapes compile on a laptop. Every compile is checked to be a real XLA backend
  compile (JAX's backend-compile event fires exactly once for it).
* whole warm-up: `Engine(load_config(preset, {"engine.scan_layers": ...}))` then
  `engine.warmup()` (every bucket of the preset, compiled and run once).

    python benchmarks/compile_time.py [--only tiny,bench,llama3_8b,llama3_8b_80] [--no-warmup]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

import jax
import numpy as np
from flax import nnx

from jaxfill.models.execution_plan import ExecutionPlan
from jaxfill.engine.batch import dummy_batch
from jaxfill.engine.config import load_config
from jaxfill.engine.step import StaticGraph, step
from jaxfill.models.kv_cache import KVCache
from jaxfill.models.decoder import Decoder

# (name, preset, overrides): num_pages is the preset's, or 1024 where the preset sizes the pool
SHAPES = [("tiny", "tiny_random", {}),
          ("bench", "bench", {}),
          ("llama3_8b", "llama3_8b", {"engine.num_pages": 1024}),
          ("llama3_8b_80", "llama3_8b", {"engine.num_pages": 1024, "model.num_layers": 80})]
WARMUP_PRESETS = ["tiny_random", "bench"]
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_backend_compiles: list[float] = []


def _on_event(event: str, secs: float, **_) -> None:
    if event == BACKEND_COMPILE_EVENT:
        _backend_compiles.append(secs)


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), tree)


def step_args(config, stages: int, bucket: tuple[int, int]) -> tuple:
    """(graph, state, kv_cache, batch, prev_tokens), everything but the graph abstract."""
    m, e = config.model, config.engine
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(m, nnx.Rngs(0), plan=ExecutionPlan.stacked(stages))))
    cache = jax.eval_shape(lambda: KVCache.create(m, e.num_pages, e.page_size, stages=stages))
    batch = _abstract(dummy_batch(bucket, e.max_pages_per_seq, e.penalty_window, config.model.vocab_size))
    prev_tokens = jax.ShapeDtypeStruct((e.max_num_seqs,), np.int32)
    return StaticGraph(graphdef), state, cache, batch, prev_tokens


def _nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def compile_step(args: tuple) -> dict:
    """One real compile of the engine's step on `args`: a fresh jit after clearing every
    in-memory cache; asserts XLA's backend compile ran exactly once."""
    jax.clear_caches()
    jitted = jax.jit(step.__wrapped__, static_argnums=0, donate_argnums=2)
    n = len(_backend_compiles)
    t0 = time.perf_counter()
    lowered = jitted.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    if len(_backend_compiles) != n + 1:
        raise RuntimeError(f"expected one backend compile, saw {len(_backend_compiles) - n}")
    mem = compiled.memory_analysis()
    return {"lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0,
            "backend_compile_s": _backend_compiles[-1],
            "temp_bytes": int(mem.temp_size_in_bytes) if mem is not None else None,
            "argument_bytes": int(mem.argument_size_in_bytes) if mem is not None else None,
            "cache_bytes": _nbytes(args[2]), "param_bytes": _nbytes(args[1])}


def per_bucket_rows(names: list[str], buckets: list[tuple[int, int]]):
    for name, preset, extra in SHAPES:
        if names and name not in names:
            continue
        config = load_config(preset, extra)
        layers = config.model.num_layers
        for bucket in buckets:
            for variant, stages in (("unrolled", 1), ("scan", layers)):
                row = {"model": name, "layers": layers, "dtype": config.model.dtype, "variant": variant,
                       "bucket": list(bucket), "num_pages": config.engine.num_pages,
                       **compile_step(step_args(config, stages, bucket)), "loadavg": os.getloadavg()}
                yield row


def warmup_row(preset: str, scan: bool) -> dict:
    """Engine construction, then the whole warm-up, persistent cache off and nothing in memory."""
    from jaxfill.engine.engine import Engine

    jax.clear_caches()
    config = load_config(preset, {"engine.scan_layers": scan})
    t0 = time.perf_counter()
    engine = Engine(config, progress=False, warmup=False)
    t1 = time.perf_counter()
    n = len(_backend_compiles)
    engine.warmup(progress=False)
    t2 = time.perf_counter()
    row = {"preset": preset, "layers": config.model.num_layers, "variant": "scan" if scan else "unrolled",
           "buckets": [list(s) for s in engine.shapes], "construct_s": t1 - t0, "warmup_s": t2 - t1,
           "warmup_backend_compiles": len(_backend_compiles) - n,
           "warmup_backend_compile_s": sum(_backend_compiles[n:]), "loadavg": os.getloadavg()}
    engine.close()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--buckets", default="16x16,256x16", help="tokens x seqs, comma-separated")
    p.add_argument("--only", default="", help="comma-separated subset of " + ",".join(s[0] for s in SHAPES))
    p.add_argument("--no-per-bucket", action="store_true")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--out", default="benchmarks/results/compile_time.json")
    args = p.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)
    jax.monitoring.register_event_duration_secs_listener(_on_event)
    buckets = [tuple(int(v) for v in b.split("x")) for b in args.buckets.split(",")]
    names = [n for n in args.only.split(",") if n]
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "jax": jax.__version__, "backend": jax.default_backend(),
              "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
              "loadavg_start": os.getloadavg(), "per_bucket": [], "warmup": []}

    def save() -> None:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    if not args.no_per_bucket:
        for row in per_bucket_rows(names, buckets):
            result["per_bucket"].append(row)
            print(f"{row['model']:>13} L={row['layers']:<3} {row['variant']:>8} {row['bucket']}: "
                  f"lower {row['lower_s']:.1f} s, compile {row['compile_s']:.1f} s, "
                  f"temp {row['temp_bytes'] / 2**20:.1f} MiB (cache {row['cache_bytes'] / 2**20:.1f} MiB), "
                  f"load {row['loadavg'][0]:.1f}", flush=True)
            save()
    if not args.no_warmup:
        for preset in WARMUP_PRESETS:
            for scan in (False, True):
                row = warmup_row(preset, scan)
                result["warmup"].append(row)
                print(f"warm-up {preset} {row['variant']}: construct {row['construct_s']:.1f} s, "
                      f"{row['warmup_backend_compiles']} compiles, warm-up {row['warmup_s']:.1f} s", flush=True)
                save()
    result["loadavg_end"] = os.getloadavg()
    save()


if __name__ == "__main__":
    main()
