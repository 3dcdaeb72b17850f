"""The MoE layer on CPU: grouped-matmul implementations, and collectives under mesh.expert.

    python benchmarks/moe_cpu.py [--tokens 512 2048] [--repeats 5] [--out benchmarks/results/moe_cpu.json]

1. One MoE MLP (models/moe.py `grouped_experts`: 8 experts, top 2, H=512, I=1408, the
   bench shape's MLP as experts) on `tokens` tokens, one CPU device, f32, median of
   `repeats` after a warm-up, in one process side by side:
     * `tiled`: our tile loop over (tile, expert) pairs (models/grouped_matmul.py);
     * `ragged_dot`: `jax.lax.ragged_dot`, which XLA:CPU lowers densely (masked, every
       expert on every row);
     * `dense loop`: every token through every expert, weighted by its router weight
       (0 for the experts it did not pick): the no-grouped-matmul baseline.
   The ideal is the active FLOPs (2 experts per token); `flops_x_active` is what each
   pays per useful FLOP (from XLA's cost analysis of the compiled program).
2. Collectives: the forward of a 2-layer Mixtral-shaped model (8 experts) on 4 fake CPU
   devices, mesh.expert=4 and expert 2 x tensor 2 (a subprocess with
   --xla_force_host_platform_device_count=4): all-reduce bytes per layer in the compiled
   HLO against the planner's count (two [T, E] all-reduces per layer, attention's and the
   MoE's, over tensor x expert; the last layer's on its sampled row only) plus the
   vocab-parallel embedding's one, which the planner leaves out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "moe_cpu.json")
E, K, H, I = 8, 2, 512, 1408


def time_impls(tokens: list[int], repeats: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxfill.models.moe import grouped_experts

    rng = np.random.default_rng(0)
    gate_up = jnp.asarray(rng.standard_normal((E, H, 2, I)) * 0.03, jnp.float32)
    down = jnp.asarray(rng.standard_normal((E, I, H)) * 0.03, jnp.float32)

    def dense_loop(x, weights, ids, gate_up, down):  # every expert on every token
        out = jnp.zeros(x.shape, jnp.float32)
        for e in range(E):
            h = jnp.einsum("th,hsi->tsi", x, gate_up[e])
            y = (jax.nn.silu(h[:, 0]) * h[:, 1]) @ down[e]
            out = out + y * jnp.sum(jnp.where(ids == e, weights, 0.0), axis=1, keepdims=True)
        return out

    def grouped(impl):
        return jax.jit(lambda x, w, ids, gate_up, down: grouped_experts(
            x, w, ids, {"gate_up": gate_up, "down": down}, 0, "silu", impl=impl))

    fns = {"tiled": grouped("tiled"), "ragged_dot": grouped("ragged_dot"),
           "dense loop": jax.jit(dense_loop)}
    rows = []
    for t in tokens:
        x = jnp.asarray(rng.standard_normal((t, H)), jnp.float32)
        weights = jnp.asarray(rng.random((t, K)), jnp.float32)
        ids = jnp.asarray(np.stack([rng.permutation(E)[:K] for _ in range(t)]), jnp.int32)
        args = (x, weights, ids, gate_up, down)
        active = 2 * t * K * 3 * H * I
        want = np.asarray(fns["dense loop"](*args))
        for name, fn in fns.items():
            compiled = fn.lower(*args).compile()
            # XLA's cost analysis counts a loop body once: the tiled loop's FLOPs are counted here
            flops = (tiled_flops(np.bincount(np.asarray(ids).ravel(), minlength=E), t * K) if name == "tiled"
                     else float((compiled.cost_analysis() or {}).get("flops", float("nan"))))
            got = np.asarray(compiled(*args))
            err = float(np.abs(got - want).max() / np.abs(want).max())
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                compiled(*args).block_until_ready()
                times.append(time.perf_counter() - start)
            rows.append({"tokens": t, "impl": name, "median_s": statistics.median(times), "times_s": times,
                         "flops": flops, "flops_x_active": flops / active, "max_rel_diff_vs_dense": err})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def tiled_flops(sizes, rows: int, tile: int = 128) -> float:
    """Matmul FLOPs of models/grouped_matmul.py's tiled loop: one tile matmul per (group,
    tile) pair it visits, for the gate/up and the down projection."""
    tile = min(tile, max(8, 1 << (rows - 1).bit_length()))
    ends = np.cumsum(sizes)
    visits = sum((e - 1) // tile - (e - s) // tile + 1 for s, e in zip(sizes, ends) if s)
    return 2.0 * visits * tile * (H * 2 * I + I * H)


def collectives(tokens: int) -> list[dict]:
    """Runs under 4 fake devices (see main)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hlo_collectives import collective_ops
    from jaxfill.engine.config import MeshSettings
    from jaxfill.engine.mesh import make_mesh
    from jaxfill.engine.placement import init_sharded
    from jaxfill.engine.planner.hardware import load_hardware
    from jaxfill.engine.planner.plan import device_costs
    from jaxfill.models.config import ModelConfig
    from jaxfill.models.forward import forward
    from jaxfill.models.kv_cache import KVCache, single_sequence_metadata

    cfg = ModelConfig.of(architecture="MixtralForCausalLM", vocab_size=512, hidden_size=256, intermediate_size=512,
                      num_layers=2, num_heads=8, num_kv_heads=4, head_dim=32, num_experts=8, experts_per_token=2,
                      moe_intermediate_size=512)
    page = 16
    meta = single_sequence_metadata(tokens, 0, list(range(1, tokens // page + 1)), page)
    tok = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, tokens), jnp.int32)
    pos = jnp.arange(tokens, dtype=jnp.int32)
    rows = []
    for expert, tensor in ((4, 1), (2, 2)):
        settings = MeshSettings(expert=expert, tensor=tensor)
        mesh = make_mesh(settings)
        graphdef, state = init_sharded(cfg, mesh, "xla")
        cache = KVCache.create(cfg, tokens // page + 2, page, mesh=mesh)
        with jax.set_mesh(mesh):
            compiled = forward.lower(graphdef, state, tok, pos, cache, meta).compile()
        ops = collective_ops(compiled.as_text())
        cost = device_costs(cfg, settings, load_hardware("h100_sxm"), tokens)
        n = settings.heads
        planned = cost.collective_bytes / (2 * (n - 1) / n)  # the planner counts ring bytes sent
        embedding = tokens * cfg.hidden_size * 4  # the vocab-parallel lookup's all-reduce, outside the layers
        rows.append({"expert": expert, "tensor": tensor, "tokens": tokens,
                     "hlo_all_reduce_bytes": ops["all-reduce_bytes"],
                     "planner_all_reduce_bytes": planned, "embedding_all_reduce_bytes": embedding,
                     "full_layer_all_reduce_bytes": 2 * embedding,
                     "collectives": {k: v for k, v in ops.items() if v}})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--collectives-worker", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.collectives_worker:
        print("RESULT " + json.dumps(collectives(args.collectives_worker)))
        return
    t0 = time.time()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.run([sys.executable, __file__, "--collectives-worker", "512"], env=env, cwd=ROOT,
                          capture_output=True, text=True, check=True)
    coll = json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])
    impls = time_impls(args.tokens, args.repeats)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "shape": {"experts": E, "top_k": K, "hidden": H,
                                                                    "intermediate": I},
              "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
              "impls": impls, "collectives": coll, "wall_s": time.time() - t0}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("| tokens | impl | median | x tiled | FLOPs / active FLOPs |\n|---|---|---|---|---|")
    for r in impls:
        base = next(x for x in impls if x["tokens"] == r["tokens"] and x["impl"] == "tiled")
        print(f"| {r['tokens']} | {r['impl']} | {r['median_s'] * 1e3:.1f} ms | {r['median_s'] / base['median_s']:.2f} "
              f"| {r['flops_x_active']:.2f} |")
    print("\n| mesh | HLO all-reduce bytes | planner (layers) + embedding lookup |\n|---|---|---|")
    for r in coll:
        print(f"| expert {r['expert']} x tensor {r['tensor']} | {r['hlo_all_reduce_bytes']:.0f} | "
              f"{r['planner_all_reduce_bytes']:.0f} + {r['embedding_all_reduce_bytes']:.0f} |")


if __name__ == "__main__":
    main()
