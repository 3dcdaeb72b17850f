"""What multi-host lockstep costs: the same engine and mesh (data 2 x tensor 2, tiny
model) as one process with 4 fake CPU devices, and as two processes x 2 devices
(jax.distributed on 127.0.0.1, gloo), where process 0 broadcasts every batch.

    python benchmarks/multihost.py [--requests 16] [--max-tokens 32] [--out benchmarks/results/multihost.json]

Per run: engine.step() wall times on process 0 (median, p90), steps, and for the
two-process run the time spent in the two broadcasts per step (Lockstep.send_s). Both
runs must produce the same tokens. The fake devices share this machine's cores, so
absolute times are CPU times; the ratio and the broadcast share are the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH = {"mesh.data": 2, "mesh.tensor": 2}
ENGINE = {"engine.max_num_batched_tokens": 64, "engine.max_num_seqs": 8, "engine.num_pages": 256}


def child(args) -> None:
    sys.path.insert(0, ROOT)
    import numpy as np

    from jaxfill.engine.engine import Engine
    from jaxfill.engine.request import SamplingParams

    overrides = {**MESH, **ENGINE}
    if args.num_processes > 1:
        overrides.update({"mesh.coordinator": f"127.0.0.1:{args.port}", "mesh.num_processes": args.num_processes,
                          "mesh.process_id": args.process_id})
    with Engine.from_config("tiny_random", overrides=overrides, progress=False) as engine:
        if not engine.is_leader:
            engine.follow()
            return
        rng = np.random.RandomState(0)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        ids = [engine.add_request(rng.randint(1, 250, rng.randint(40, 160)).tolist(), params)
               for _ in range(args.requests)]
        tokens = {rid: [] for rid in ids}
        step_s = []
        while engine.has_unfinished():
            start = time.perf_counter()
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
            step_s.append(time.perf_counter() - start)
        lock = engine.runner.lockstep
        sends = lock.num_sent if lock else 0
        result = {"processes": args.num_processes, "steps": len(step_s),
                  "step_ms_median": 1e3 * float(np.median(step_s)), "step_ms_p90": 1e3 * float(np.percentile(step_s, 90)),
                  "broadcast_ms_per_step": 1e3 * lock.send_s / sends if lock else 0.0,
                  "step_ms": [round(1e3 * x, 3) for x in step_s],
                  "tokens": [tokens[r] for r in ids]}
    with open(args.out, "w") as f:
        json.dump(result, f)


def launch(num_processes: int, devices: int, args, tmp: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    out = os.path.join(tmp, f"run{num_processes}.json")
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", "--process-id", str(i),
                               "--num-processes", str(num_processes), "--port", str(port), "--out", out,
                               "--requests", str(args.requests), "--max-tokens", str(args.max_tokens)], env=env)
             for i in reversed(range(num_processes))]
    for p in procs:
        if p.wait(1800) != 0:
            raise SystemExit(f"a process of the {num_processes}-process run failed")
    with open(out) as f:
        return json.load(f)


def plot(result: dict, path: str) -> None:
    """CDF of engine.step() wall time on process 0, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r, label in zip(result["runs"], ("1 process x 4 devices", "2 processes x 2 devices (lockstep)")):
        x = np.sort(r["step_ms"])
        ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=label)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks([5, 10, 20, 50, 100, 200, 500])
    ax.set_xlabel("engine.step() on process 0 (ms)")
    ax.set_ylabel("fraction of steps")
    ax.set_title(f"data 2 x tensor 2, tiny model, CPU fake devices ({result['date']})")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "multihost.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--num-processes", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    import tempfile

    from tqdm import tqdm

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, devices in tqdm([(1, 4), (2, 2)], desc="runs (1 process x 4 devices, 2 x 2)", unit="run"):
            runs.append(launch(n, devices, args, tmp))
    one, two = runs
    same = one["tokens"] == two["tokens"]
    result = {"mesh": MESH, "engine": ENGINE, "requests": args.requests, "max_tokens": args.max_tokens,
              "machine": f"{os.cpu_count()} cores, CPU fake devices", "date": time.strftime("%Y-%m-%d"),
              "same_tokens": same, "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs],
              "step_ratio_2proc_vs_1proc": two["step_ms_median"] / one["step_ms_median"]}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.splitext(args.out)[0] + ".png")
    print("| processes x devices | steps | step ms median | p90 | broadcast ms / step |")
    print("|---|---:|---:|---:|---:|")
    for r, label in zip(result["runs"], ("1 x 4", "2 x 2")):
        print(f"| {label} | {r['steps']} | {r['step_ms_median']:.1f} | {r['step_ms_p90']:.1f} "
              f"| {r['broadcast_ms_per_step']:.2f} |")
    print(f"same tokens: {same}; step time ratio 2 processes / 1: {result['step_ratio_2proc_vs_1proc']:.2f}")
    if not same:
        raise SystemExit("the two-process run gave different tokens")


if __name__ == "__main__":
    main()
