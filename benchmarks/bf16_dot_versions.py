"""Does any jax version or XLA:CPU flag give bf16 dots the CPU's avx512_bf16 rate? (issue 51 item 4)

    python benchmarks/bf16_dot_versions.py --python /path/to/python [--python ...] [--rounds 2]

The bench shape's MLP matmul (2048 x 512 @ 512 x 1408) in f32 and bf16 (f32 accumulation,
`preferred_element_type`), GFLOP/s on one core (each worker pinned with
`os.sched_setaffinity`, one XLA:CPU device, no intra-op threads), for every interpreter given
(each has its own jax / jaxlib) and every flag set, each in a fresh process (XLA_FLAGS are
read once). A flag an XLA build does not know aborts that process: reported as "unknown
flag". torch's bf16 and f32 rates on the same core are the reference, where torch imports.
Writes benchmarks/results/bf16_dot_versions.json.
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
RESULTS = os.path.join(ROOT, "benchmarks", "results", "bf16_dot_versions.json")
M, K, N = 2048, 512, 1408
FLAG_SETS = {
    "default": "",
    "oneDNN": "--xla_cpu_use_onednn=true",
    "XNNPACK dots": "--xla_cpu_experimental_xnn_fusion_type=dot",
    "YNNPACK dots": "--xla_cpu_experimental_ynn_fusion_type=dot",
    "oneDNN dot fusions": "--xla_cpu_experimental_onednn_fusion_type=dot",
}

WORKER = r"""
import json, os, statistics, sys, time
os.sched_setaffinity(0, {0})
M, K, N = %d, %d, %d
def rate(fn, repeats=7):
    fn(); fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter(); fn(); times.append(time.perf_counter() - t0)
    return 2 * M * K * N / statistics.median(times) / 1e9
out = {}
if sys.argv[1] == "torch":
    import torch
    torch.set_num_threads(1)
    for name, dt in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        x, w = torch.randn(M, K, dtype=dt), torch.randn(K, N, dtype=dt)
        out[name] = rate(lambda: x @ w)
    out["version"] = torch.__version__
else:
    import jax, jax.numpy as jnp, numpy as np
    rng = np.random.default_rng(0)
    for name, dt in (("f32", jnp.float32), ("bf16", jnp.bfloat16)):
        x = jnp.asarray(rng.standard_normal((M, K)), dt)
        w = jnp.asarray(rng.standard_normal((K, N)), dt)
        dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
        out[name] = rate(lambda: dot(x, w).block_until_ready())
    out["version"] = jax.__version__ + " / jaxlib " + __import__("jaxlib").__version__
print(json.dumps(out))
""" % (M, K, N)


def run(python: str, what: str, flags: str) -> dict:
    env = {**os.environ, "XLA_FLAGS": (flags + " --xla_cpu_multi_thread_eigen=false").strip(),
           "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([python, "-c", WORKER, what], env=env, capture_output=True, text=True, timeout=600)
    if out.returncode:
        tail = out.stderr.strip().splitlines()[-1:] or ["?"]
        return {"error": "unknown flag" if "Unknown flag" in out.stderr or "unknown" in tail[0].lower() else tail[0]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", action="append", required=True, help="an interpreter with jax (repeatable)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    rows: dict = {}
    for r in range(args.rounds):  # rounds alternate, so a burst of load hits every cell alike
        for python in args.python:
            for label, flags in FLAG_SETS.items():
                res = run(python, "jax", flags)
                key = f"{python} | {label}"
                rows.setdefault(key, []).append(res)
                print(f"round {r + 1} {key}: {res}", file=sys.stderr, flush=True)
            torch_res = run(python, "torch", "")
            if "error" not in torch_res:
                rows.setdefault(f"{python} | torch", []).append(torch_res)
                print(f"round {r + 1} {python} | torch: {torch_res}", file=sys.stderr, flush=True)
    table = {}
    for key, results in rows.items():
        ok = [x for x in results if "error" not in x]
        table[key] = ({"version": ok[0]["version"], **{k: round(statistics.median(x[k] for x in ok), 1)
                                                      for k in ("f32", "bf16")}} if ok else results[0])
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "shape": [M, K, N],
              "load": os.getloadavg()[0], "gflops_one_core": table}
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
