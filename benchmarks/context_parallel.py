"""Context parallelism (mesh.sequence = N, issue 28) on fake CPU devices: per-device memory,
TTFT, and the collectives of one prefill step.

    python benchmarks/context_parallel.py [--mem-lengths 4096 16384 65536 131072]
        [--ttft-lengths 4096 8192 16384 32768] [--repeats 3] [--chunk 4096]
    python benchmarks/context_parallel.py --replot

tiny_random (4 layers, 4 query heads and 2 KV heads of 32, f32) with max_position_embeddings
and max_model_len raised to the longest S. One subprocess per N (the fake device count,
XLA_FLAGS=--xla_force_host_platform_device_count=N, is fixed when jax starts); N = 1 runs
on one device with mesh.cpu_split = false.

1. memory (N = 1, 2, 4, 8): for each S a pool of ceil(S / 16 / N) * N + 2N pages
   (`Runner.new_cache`), its bytes on one device read from the shards
   (`KVCache.nbytes_on`), and the engine's jitted step (`Runner.step_fn`) compiled, not
   run, for one --chunk-token prefill bucket and for the whole prompt as one chunk
   (T = S): `compiled.memory_analysis()` is the per-device SPMD program's. Shapes alone
   decide a program's buffers, so the all-padding batch of the bucket (`Runner.dummy`)
   compiles to the same program as a real prefill chunk of that size.
2. collectives (N = 4): benchmarks/hlo_collectives.py on the compiled --chunk step,
   per layer, against the pass-Q formula (models/parallel/context.py).
3. TTFT (N = 1 and 8): `Engine.generate([prompt], max_tokens=1)` wall time, chunk budget
   --chunk (one bucket), prefix caching off, a fresh random prompt per run, median of
   --repeats after one warm-up generate per engine; greedy first tokens and logprobs
   are kept so N = 8 can be checked against N = 1.

Writes benchmarks/results/context_parallel.json and context_parallel.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
PAGE = 16


def _engine(n: int, top: int, chunk: int, pages: int):
    from jaxfill.engine.config import load_config
    from jaxfill.engine.engine import Engine

    over = {"model.max_position_embeddings": top, "engine.max_model_len": top,
            "engine.max_num_batched_tokens": chunk, "engine.token_buckets": [chunk],
            "engine.max_num_seqs": 2, "engine.num_pages": pages, "engine.enable_prefix_caching": False,
            "mesh.sequence": n, "mesh.cpu_split": False}
    return Engine(load_config("tiny_random", over), progress=False, warmup=False, compile_cache=None)


def _pages(s: int, n: int) -> int:
    return math.ceil(s / PAGE / n) * n + 2 * n


def _compile(runner, cache, tokens: int):
    batch = runner.put(runner.dummy((tokens, 2)))
    with runner.mesh_context():
        return runner.step_fn.lower(runner.static_graph, runner.state, cache, batch, runner.prev_tokens, False).compile()


def _mem(compiled) -> dict:
    m = compiled.memory_analysis()
    return {k: int(getattr(m, k + "_in_bytes")) for k in
            ("temp_size", "argument_size", "output_size", "alias_size", "generated_code_size")}


def memory_worker(n: int, lengths: list[int], chunk: int) -> dict:
    import jax

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from hlo_collectives import collective_ops

    e = _engine(n, max(lengths), chunk, 2 * n)
    runner, dev = e.runner, jax.devices()[0]
    rows = []
    for s in lengths:
        t0 = time.perf_counter()
        cache = runner.new_cache(_pages(s, n))
        row = {"S": s, "num_pages": _pages(s, n), "kv_bytes_per_device": cache.nbytes_on(dev),
               "kv_bytes_total": cache.nbytes()}
        for name, tokens in (("chunk", chunk), ("whole", s)):
            compiled = _compile(runner, cache, tokens)
            row[name] = {"tokens": tokens, **_mem(compiled)}
            if name == "chunk" and s == lengths[0]:
                row["collectives"] = {k: v for k, v in collective_ops(compiled.as_text()).items() if v}
            del compiled
        del cache
        row["s"] = time.perf_counter() - t0
        print(f"N={n} S={s}: kv/device {row['kv_bytes_per_device'] / 2**20:.1f} MiB, temp chunk "
              f"{row['chunk']['temp_size'] / 2**20:.1f} MiB, whole {row['whole']['temp_size'] / 2**20:.1f} MiB "
              f"({row['s']:.0f}s)", file=sys.stderr, flush=True)
        rows.append(row)
    return {"N": n, "rows": rows}


def ttft_worker(n: int, lengths: list[int], chunk: int, repeats: int) -> dict:
    import numpy as np

    from jaxfill.engine.request import SamplingParams

    top = max(lengths)
    e = _engine(n, top + chunk, chunk, _pages(top + chunk, n))
    t0 = time.perf_counter()
    e.warmup(progress=False)
    params = SamplingParams(max_tokens=1, ignore_eos=True, logprobs=1)
    e.generate([[1] * (chunk + 7)], params)  # warm-up: a full chunk and a partial one
    out = {"N": n, "warmup_s": time.perf_counter() - t0, "lengths": {}, "first": {}}
    rng = np.random.default_rng(0)
    for s in lengths:
        times, first = [], []
        for _ in range(repeats):
            prompt = [int(x) for x in rng.integers(0, 256, s)]  # fresh each run; same seed for every N
            t = time.perf_counter()
            c = e.generate([prompt], params)[0]
            times.append(time.perf_counter() - t)
            first.append([c.token_ids[0], c.logprobs[0]["logprob"]])
        out["lengths"][str(s)], out["first"][str(s)] = times, first
        print(f"N={n} S={s}: " + " ".join(f"{x:.2f}" for x in times) + " s", file=sys.stderr, flush=True)
    return out


def formula(n: int, t: int, hq: int, hkv: int, d: int, itemsize: int = 4) -> dict:
    """Per layer and device, pass-Q: operand bytes as hlo_collectives counts them, and bytes
    each device receives ((N-1)/N of a gathered / scattered array; an all-reduce of the
    LSEs, ring, 2 (N-1)/N of it)."""
    q, kv, rs, mx = t * hq * d * itemsize, t * hkv * d * itemsize, t * hq * (d + 1) * 4, t * hq * 4
    f = (n - 1) / n
    return {"all-gather": {"count": 3, "operand_bytes": (q + 2 * kv) // n, "received_bytes": f * (q + 2 * kv)},
            "reduce-scatter": {"count": 1, "operand_bytes": rs, "received_bytes": f * rs},
            "all-reduce": {"count": 1, "operand_bytes": mx, "received_bytes": 2 * f * mx}}


def _child(args: list[str], n: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={n}",
               PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"),) if p))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *args], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, text=True)
    if proc.returncode:
        raise SystemExit(f"worker {args} failed ({proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def agreement(ttft: list[dict]) -> dict:
    """N > 1 against N = 1 on the same prompts: greedy first tokens equal, max |logprob diff|."""
    base = next((t for t in ttft if t["N"] == 1), None)
    out = {}
    for t in ttft:
        if base is None or t is base:
            continue
        pairs = [(a, b) for s in t["first"] for a, b in zip(base["first"].get(s, []), t["first"][s])]
        out[str(t["N"])] = {"runs": len(pairs), "same_token": sum(a[0] == b[0] for a, b in pairs),
                            "max_abs_logprob_diff": max((abs(a[1] - b[1]) for a, b in pairs), default=None)}
    return out


def mib(x: float) -> str:
    return f"{x / 2**20:.2f}"


def tables(r: dict) -> str:
    out = ["| N | S | pages/device | KV MiB/device | temp MiB, chunk " + str(r["chunk"]) +
           " | args MiB, chunk | temp MiB, T = S | KV + temp (chunk) MiB |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for w in r["memory"]:
        for row in w["rows"]:
            c = row["chunk"]
            out.append(f"| {w['N']} | {row['S']:,} | {row['num_pages'] // w['N']} | {mib(row['kv_bytes_per_device'])} "
                       f"| {mib(c['temp_size'])} | {mib(c['argument_size'])} | {mib(row['whole']['temp_size'])} "
                       f"| {mib(row['kv_bytes_per_device'] + c['temp_size'])} |")
    out += ["", "| collective (N = 4, T = %d) | HLO count / layer | HLO operand bytes / layer | formula count "
            "| formula operand bytes | formula received / device |" % r["chunk"], "|---|---:|---:|---:|---:|---:|"]
    for op, f in r["collectives"]["formula"].items():
        h = r["collectives"]["per_layer"].get(op, {"count": 0, "operand_bytes": 0})
        out.append(f"| {op} | {h['count']:g} | {h['operand_bytes']:,.0f} | {f['count']} | {f['operand_bytes']:,} "
                   f"| {f['received_bytes']:,.0f} |")
    for n, a in r.get("agreement", {}).items():
        out += ["", f"N = {n} vs N = 1, same prompts: {a['same_token']}/{a['runs']} greedy first tokens equal, "
                f"max |logprob diff| {a['max_abs_logprob_diff']:.2e}"]
    if r.get("ttft"):
        lengths = r["ttft_lengths"]
        out += ["", "| S | " + " | ".join(f"N = {t['N']} TTFT s | TTFT(S)/TTFT(S/2)" for t in r["ttft"]) + " |",
                "|---:|" + "---:|---:|" * len(r["ttft"])]
        for i, s in enumerate(lengths):
            cells = []
            for t in r["ttft"]:
                med = t["median"]
                cells += [f"{med[str(s)]:.2f}", f"{med[str(s)] / med[str(lengths[i - 1])]:.2f}" if i else ""]
            out.append(f"| {s:,} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, whole, ttft) = plt.subplots(1, 3, figsize=(15, 4.2))
    for w in r["memory"]:
        s = [row["S"] for row in w["rows"]]
        mem.plot(s, [(row["kv_bytes_per_device"] + row["chunk"]["temp_size"]) / 2**20 for row in w["rows"]],
                 "o-", label=f"N = {w['N']}")
        whole.plot(s, [(row["kv_bytes_per_device"] + row["whole"]["temp_size"]) / 2**20 for row in w["rows"]],
                   "o-", label=f"N = {w['N']}")
    for ax, title in ((mem, f"KV + temp per device, {r['chunk']}-token chunk"),
                      (whole, "KV + temp per device, whole prompt as one chunk")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens S")
        ax.set_ylabel("MiB")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    for t in r.get("ttft", []):
        ls = r["ttft_lengths"]
        where = f" ({t['N']} fake devices)" if t["N"] > 1 else ", one device"
        ttft.plot(ls, [t["median"][str(s)] for s in ls], "o-", label=f"N = {t['N']}{where}")
    ttft.set_xscale("log", base=2)
    ttft.set_yscale("log")
    ttft.set_xlabel("prompt tokens S")
    ttft.set_ylabel("TTFT, s (median; 2 shared cores: not a speed-up)")
    ttft.legend(fontsize=8)
    fig.suptitle("tiny_random (4 layers, 4 q / 2 kv heads of 32, f32), mesh.sequence = N on fake XLA:CPU devices",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mem-lengths", type=int, nargs="+", default=[4096, 16384, 65536, 131072])
    p.add_argument("--mem-devices", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--ttft-lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768],
                   help="65536 adds ~5 min (N = 8 ~70 s a run); 131072 is too slow on 2 cores")
    p.add_argument("--ttft-devices", type=int, nargs="+", default=[1, 8])
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--worker", choices=["memory", "ttft"], help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    p.add_argument("--replot", action="store_true")
    p.add_argument("--out", default=os.path.join(RESULTS, "context_parallel.json"))
    args = p.parse_args()
    png = os.path.splitext(args.out)[0] + ".png"
    if args.worker == "memory":
        return print(json.dumps(memory_worker(args.n, args.mem_lengths, args.chunk)))
    if args.worker == "ttft":
        return print(json.dumps(ttft_worker(args.n, args.ttft_lengths, args.chunk, args.repeats)))
    if args.replot:
        with open(args.out) as f:
            r = json.load(f)
        r["agreement"] = agreement(r.get("ttft", []))
        with open(args.out, "w") as f:
            json.dump(r, f, indent=1)
        plot(r, png)
        return print(tables(r))
    t0, load_start = time.time(), os.getloadavg()
    common = ["--chunk", str(args.chunk), "--repeats", str(args.repeats)]
    memory = [_child(["--worker", "memory", "--n", str(n), "--mem-lengths", *map(str, args.mem_lengths), *common], n)
              for n in args.mem_devices]
    print(f"memory done, {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    ttft = []
    for n in args.ttft_devices:
        t = _child(["--worker", "ttft", "--n", str(n), "--ttft-lengths", *map(str, args.ttft_lengths), *common], n)
        t["median"] = {s: statistics.median(v) for s, v in t["lengths"].items()}
        ttft.append(t)
    from jaxfill.engine.config import load_config

    m = load_config("tiny_random").model
    four = next(w for w in memory if w["N"] == 4)
    hlo = four["rows"][0]["collectives"]
    per_layer = {op: {"count": hlo.get(op, 0) / m.num_layers, "operand_bytes": hlo.get(op + "_bytes", 0) / m.num_layers}
                 for op in ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
                 if hlo.get(op)}
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "chunk": args.chunk, "repeats": args.repeats,
              "model": "tiny_random", "platform": f"cpu, fake devices on {os.cpu_count()} cores",
              "memory": memory, "ttft_lengths": args.ttft_lengths, "ttft": ttft,
              "collectives": {"N": 4, "tokens": args.chunk, "hlo_total": hlo, "per_layer": per_layer,
                              "formula": formula(4, args.chunk, m.num_heads, m.num_kv_heads, m.head_dim)},
              "agreement": agreement(ttft), "wall_s": time.time() - t0,
              "load_average_start": load_start, "load_average_end": os.getloadavg()}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, png)
    print(tables(result))


if __name__ == "__main__":
    main()
