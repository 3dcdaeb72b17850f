"""Compile time of a linear-attention hybrid's step, layers unrolled vs `engine.scan_layers`
(one scan step = one period of the layer pattern: [DeltaNet x3, attention]).

tiny_random's shapes with Gated DeltaNet layers (Qwen3.5's pattern, every 4th layer
attention) at 24 and 48 layers; per bucket, the engine's real step program compiled as in
benchmarks/compile_time.py (fresh jit after `jax.clear_caches()`, abstract params, cache,
batch: nothing allocated; one XLA backend compile checked), plus the size of the lowered
program (StableHLO characters and dot_general count). Rounds alternate the variants.

    python benchmarks/hybrid_scan_compile.py [--layers 24,48] [--rounds 2] [--out benchmarks/results/hybrid_scan_compile.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics

import jax
import numpy as np
from flax import nnx

from compile_time import _abstract, _on_event, compile_step  # benchmarks/compile_time.py
from jaxfill.engine.batch import dummy_batch
from jaxfill.engine.config import load_config
from jaxfill.engine.step import StaticGraph, step
from jaxfill.models.decoder import Decoder
from jaxfill.models.execution_plan import ExecutionPlan, scan_period
from jaxfill.models.kv_cache import KVCache

HYBRID = {"model.linear_kind": "gated_deltanet", "model.linear_num_key_heads": 2, "model.linear_num_value_heads": 4,
          "model.linear_key_head_dim": 32, "model.linear_value_head_dim": 32, "model.linear_conv_kernel": 4}


def hybrid_config(layers: int):
    return load_config("tiny_random", {**HYBRID, "model.num_layers": layers,
                                       "model.linear_layers": [n for n in range(layers) if n % 4 != 3]})


def step_args(config, groups: int, bucket: tuple[int, int]) -> tuple:
    m, e = config.model, config.engine
    graphdef, state = nnx.split(nnx.eval_shape(
        lambda: Decoder(m, nnx.Rngs(0), plan=ExecutionPlan.stacked(groups, scan=groups > 1))))
    cache = jax.eval_shape(lambda: KVCache.create(m, e.num_pages, e.page_size, stages=groups,
                                                  state_slots=e.state_pool_slots))
    batch = _abstract(dummy_batch(bucket, e.max_pages_per_seq, e.penalty_window, m.vocab_size))
    prev = jax.ShapeDtypeStruct((e.max_num_seqs,), np.int32)
    return StaticGraph(graphdef), state, cache, batch, prev


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default="24,48")
    p.add_argument("--buckets", default="16x16,256x16")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/hybrid_scan_compile.json")
    args = p.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)
    jax.monitoring.register_event_duration_secs_listener(_on_event)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "jax": jax.__version__, "backend": jax.default_backend(), "cores": os.cpu_count(), "rows": []}
    for layers in (int(v) for v in args.layers.split(",")):
        config = hybrid_config(layers)
        groups = layers // scan_period(config.model)
        for bucket in (tuple(int(v) for v in b.split("x")) for b in args.buckets.split(",")):
            variants = {"unrolled": step_args(config, 1, bucket), "scan": step_args(config, groups, bucket)}
            times = {v: [] for v in variants}
            for r in range(args.rounds):
                for v in (variants if r % 2 == 0 else reversed(list(variants))):
                    times[v].append(compile_step(variants[v]))
            for v, a in variants.items():
                text = step.lower(*a).as_text()
                row = {"layers": layers, "groups": groups if v == "scan" else 1, "variant": v, "bucket": list(bucket),
                       "compile_s": statistics.median(t["total_s"] for t in times[v]),
                       "all_s": [round(t["total_s"], 2) for t in times[v]],
                       "temp_bytes": times[v][0]["temp_bytes"], "hlo_chars": len(text),
                       "dot_generals": text.count("dot_general"), "loadavg": os.getloadavg()}
                result["rows"].append(row)
                print(f"L={layers} {v:>8} {bucket}: compile {row['compile_s']:.1f} s {row['all_s']}, "
                      f"HLO {row['hlo_chars'] / 1e3:.0f}k chars, {row['dot_generals']} dots, "
                      f"load {row['loadavg'][0]:.1f}", flush=True)
            os.makedirs(os.path.dirname(args.out), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
