"""Sharded prefill on fake CPU devices: per-device FLOPs / bytes, collective bytes, wall time.

    python benchmarks/sharding.py [--tokens 2048] [--repeats 3] [--out benchmarks/results/sharding.json]

For each mesh layout (tensor 2/4/8, sequence 2/4, tensor 2 x sequence 4, data 2,
data 2 x tensor 2 x sequence 2, and the 1-device baseline) on configs/bench.toml's
model, one prefill of `tokens` tokens per data replica:
  * flops / bytes accessed per device: compiled.cost_analysis() of the SPMD program;
  * collective bytes per prefill token: operand sizes of all-reduce / all-gather /
    reduce-scatter / collective-permute in the compiled HLO, summed, / tokens;
  * wall time (median of repeats) with the 8 fake devices sharing this machine's cores,
    so it measures overheads, not a real speed-up.
Runs itself in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = [(1, 1, 1), (1, 2, 1), (1, 4, 1), (1, 8, 1), (1, 1, 2), (1, 1, 4), (1, 2, 4),
           (2, 1, 1), (2, 2, 2)]  # (data, tensor, sequence)


def run(tokens: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxfill.engine.config import MeshSettings, load_config
    from hlo_collectives import collective_ops
    from jaxfill.engine.mesh import make_mesh
    from jaxfill.engine.placement import init_sharded
    from jaxfill.models.kv_cache import KVCache
    from jaxfill.models.forward import forward, forward_data_parallel
    from jaxfill.models.kv_cache import single_sequence_metadata

    config = load_config(os.path.join(ROOT, "configs", "bench.toml"))
    cfg, page_size = config.model, config.engine.page_size
    num_pages = tokens // page_size + 2
    meta = single_sequence_metadata(tokens, 0, list(range(1, tokens // page_size + 1)), page_size)
    rng = np.random.RandomState(0)
    tok = jnp.asarray(rng.randint(0, cfg.vocab_size, tokens).astype(np.int32))
    pos = jnp.arange(tokens, dtype=jnp.int32)
    rows = []
    for d, t, s in LAYOUTS:
        mesh = make_mesh(MeshSettings(data=d, tensor=t, sequence=s), devices=jax.devices()[: d * t * s])
        graphdef, state = init_sharded(cfg, mesh, config.engine.attention_impl)
        cache = KVCache.create(cfg, num_pages, page_size, mesh=mesh)  # num_pages per replica
        if d > 1:  # one prefill per replica, metadata stacked [d, ...], page ids local to each pool
            fn = forward_data_parallel
            args = (jnp.tile(tok, d), jnp.tile(pos, d), cache, jax.tree.map(lambda x: np.stack([x] * d), meta))
        else:
            fn, args = forward, (tok, pos, cache, meta)
        with jax.set_mesh(mesh):
            start = time.perf_counter()
            compiled = fn.lower(graphdef, state, *args).compile()
            compile_s = time.perf_counter() - start
            cost = compiled.cost_analysis()
            ops = collective_ops(compiled.as_text())
            times = []
            for _ in range(repeats + 1):  # first run warms up
                start = time.perf_counter()
                logits, cache = compiled(state, *args[:2], cache, args[3])
                logits.block_until_ready()
                times.append(time.perf_counter() - start)
        coll = sum(ops[k + "_bytes"] for k in ("all-reduce", "all-gather", "reduce-scatter", "collective-permute"))
        row = {"data": d, "tensor": t, "sequence": s, "devices": d * t * s, "prefill_tokens": d * tokens,
               "flops_per_device": float(cost["flops"]), "bytes_accessed_per_device": float(cost["bytes accessed"]),
               "collective_bytes_per_token": coll / (d * tokens),
               "collectives": {k: v for k, v in ops.items() if v},
               "wall_s": float(np.median(times[1:])), "compile_s": compile_s}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        del state, cache, logits
    base = rows[0]
    for row in rows:
        per_token = row["prefill_tokens"] / base["prefill_tokens"]  # data replicas each run a prefill
        row["flops_vs_1"] = row["flops_per_device"] / base["flops_per_device"] / per_token
        row["bytes_vs_1"] = row["bytes_accessed_per_device"] / base["bytes_accessed_per_device"] / per_token
    return {"model": "configs/bench.toml", "tokens": tokens, "dtype": cfg.dtype,
            "attention_impl": config.engine.attention_impl, "platform": "cpu, 8 fake devices on "
            f"{os.cpu_count()} cores", "jax": jax.__version__, "layouts": rows}


def table(result: dict) -> str:
    lines = ["| data x tensor x sequence | prefill tokens | GFLOP/device | x vs 1 per token | GB accessed/device "
             "| collective B/token | wall s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["layouts"]:
        lines.append(f"| {r.get('data', 1)} x {r['tensor']} x {r['sequence']} | {r.get('prefill_tokens', result['tokens'])} "
                     f"| {r['flops_per_device'] / 1e9:.1f} | {r['flops_vs_1']:.3f} "
                     f"| {r['bytes_accessed_per_device'] / 1e9:.2f} | {r['collective_bytes_per_token']:.0f} "
                     f"| {r['wall_s']:.2f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "sharding.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.child:
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                                          " --xla_force_host_platform_device_count=8").strip(),
                   JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        sys.exit(subprocess.call([sys.executable, os.path.abspath(__file__), "--child", *sys.argv[1:]], env=env))
    sys.path.insert(0, ROOT)
    result = run(args.tokens, args.repeats)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(table(result))


if __name__ == "__main__":
    main()
