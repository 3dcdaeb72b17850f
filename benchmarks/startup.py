"""What the persistent compilation cache saves at start-up (issue 11, item 4).

Times `jaxfill generate` end to end in fresh processes (import, model build, warm-up of
every shape bucket, 2 generated tokens): once with the cache off, once into an empty cache
(cold), once from that cache (warm), `--rounds` times alternating. Writes
benchmarks/results/startup.json.

    python benchmarks/startup.py [--config bench] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed_generate(config: str, cache: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child): CPU time is the steadier figure on a shared machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != "JAXFILL_COMPILE_CACHE"}
    cmd = [sys.executable, "-m", "jaxfill.serving.cli", "generate", "--config", config, "--prompt-ids", "1,2,3",
           "--max-tokens", "2", "--json", "--compile-cache", cache]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise SystemExit(out.stderr)
    return elapsed, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="bench")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "startup.json"))
    args = ap.parse_args()
    times: dict[str, list[float]] = {"off": [], "cold": [], "warm": []}
    cpu: dict[str, list[float]] = {"off": [], "cold": [], "warm": []}
    load_before = os.getloadavg()[0]
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as cache:
            for kind, where in (("off", "none"), ("cold", cache), ("warm", cache)):
                wall, used = timed_generate(args.config, where)
                times[kind].append(wall)
                cpu[kind].append(used)
                print(f"round {r + 1}/{args.rounds} {kind}: {wall:.1f} s wall, {used:.1f} s CPU",
                      file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    result = {"date": time.strftime("%Y-%m-%d"), "config": args.config, "wall_s": times, "cpu_s": cpu,
              "median_wall_s": med, "median_cpu_s": med_cpu,
              "warm_over_off_wall": med["warm"] / med["off"], "warm_over_off_cpu": med_cpu["warm"] / med_cpu["off"],
              "loadavg_before": load_before, "loadavg_after": os.getloadavg()[0]}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("median_wall_s", "median_cpu_s", "warm_over_off_wall",
                                             "warm_over_off_cpu")}))


if __name__ == "__main__":
    main()
