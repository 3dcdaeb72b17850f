"""What XLA:CPU's threading flags do to jaxfill's two hot ops, each flag set in its own process.

    python benchmarks/cpu_threading_flags.py [--rounds 2]

Ops: the bench shape's MLP matmul (2048 x 512 @ 512 x 1408, f32) and causal prefill
attention at 2048 tokens (impl "xla", Hq 8 / Hkv 2 / D 64, paged). Each flag set runs in
a fresh process (XLA_FLAGS are read once, when the backend starts); rounds alternate,
and the table quotes the median over rounds of each process's median of 5 calls.
Writes benchmarks/results/cpu_threading_flags.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "cpu_threading_flags.json")
FLAG_SETS = {
    "default": "",
    "no intra-op Eigen threads": "--xla_cpu_multi_thread_eigen=false",
    "concurrency scheduler": "--xla_cpu_enable_concurrency_optimized_scheduler=true",
    "XNNPACK dots": "--xla_cpu_experimental_xnn_fusion_type=dot",
    "oneDNN": "--xla_cpu_use_onednn=true",
    "vector width 512": "--xla_cpu_prefer_vector_width=512",
}


def worker() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxfill.pallas_kernels import ragged_paged_attention

    def median_ms(fn, repeats=5):
        fn()
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2048, 512), np.float32))
    w = jnp.asarray(rng.standard_normal((512, 1408), np.float32))
    matmul = jax.jit(jnp.dot)
    seq, hq, hkv, d, page = 2048, 8, 2, 64, 16
    q = jnp.asarray(rng.standard_normal((seq, hq, d), np.float32))
    pages = jnp.asarray(rng.standard_normal((seq // page, page, 2 * hkv, d), np.float32))
    meta = (jnp.asarray([seq], jnp.int32), jnp.asarray(rng.permutation(seq // page)[None].astype(np.int32)),
            jnp.asarray([0, seq], jnp.int32), jnp.asarray([1], jnp.int32))
    attend = jax.jit(lambda q, p, *m: ragged_paged_attention(q, p, *m, sm_scale=d ** -0.5, impl="xla"))
    return {"matmul_ms": median_ms(lambda: matmul(x, w).block_until_ready()),
            "attention_ms": median_ms(lambda: attend(q, pages, *meta).block_until_ready())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker()))
        return
    load_start = os.getloadavg()
    per = {name: [] for name in FLAG_SETS}
    for i in range(args.rounds):
        for name in (list(FLAG_SETS) if i % 2 == 0 else list(FLAG_SETS)[::-1]):
            env = dict(os.environ, XLA_FLAGS=FLAG_SETS[name])
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker"], env=env, cwd=ROOT,
                                 stdout=subprocess.PIPE, text=True, check=True)
            per[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    rows = [{"flags": name, "xla_flags": FLAG_SETS[name],
             "matmul_ms": statistics.median(r["matmul_ms"] for r in runs),
             "attention_ms": statistics.median(r["attention_ms"] for r in runs)} for name, runs in per.items()]
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu_count": os.cpu_count(),
              "load_average_start": load_start, "load_average_end": os.getloadavg(), "rounds": args.rounds,
              "rows": rows, "raw": per}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("| XLA_FLAGS | matmul 2048x512x1408 ms | attention 2048 ms |")
    print("|---|---:|---:|")
    for r in rows:
        print(f"| {r['flags']} (`{r['xla_flags'] or 'none'}`) | {r['matmul_ms']:.1f} | {r['attention_ms']:.1f} |")
    print(f"load average {load_start[0]:.1f} -> {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
