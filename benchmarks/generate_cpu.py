"""Prefill through `Engine.generate` vs the bare jitted forward vs transformers, on CPU.

    python benchmarks/generate_cpu.py [--lengths 128 512 2048 8192] [--devices 0 1 2]
        [--dtypes float32 bfloat16] [--rounds 2] [--repeats 3] [--arch llama|qwen3|gemma3]

One prompt, `SamplingParams(max_tokens=1)`: the time of `Engine.generate` is the TTFT a
user sees (scheduling, batch building, device transfer, the jitted step with its
sampler, detokenizing). Next to it, in the same process and on the same engine (same
params, same KV cache, same mesh), the bare `models.forward.forward` on the same prompt:
the difference is the engine's overhead. `--devices N` starts jaxfill with N XLA CPU
devices (--xla_force_host_platform_device_count) and mesh.tensor = N, the heads split
over them; `--devices 0` is the engine's own CPU default (no flag, no mesh setting: one
XLA CPU device per core and the heads split over them, engine/cpu_devices.py). Each
length gets its own engine whose one token bucket is the prompt, so neither side pays for
padding (with the default buckets 16, 64, 256, 1024, 2048 a 128-token prompt would run
in the 256 bucket). transformers runs `benchmarks/prefill_hf_worker.py` (sdpa, logits_to_keep=1,
--threads threads) on the same random-init bench-shape checkpoint. Every configuration
runs in its own process, rounds alternate the order, and the tables quote medians and
ratios of this one run. `--arch` saves the bench shape as another family instead
(prefill_hf_worker.py ARCHS: Qwen3, Gemma 3 and 4 text, Qwen3.5-MoE, DeepSeek V3.2). Writes benchmarks/results/generate_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF_WORKER = os.path.join(ROOT, "benchmarks", "prefill_hf_worker.py")
RESULTS = os.path.join(ROOT, "benchmarks", "results", "generate_cpu.json")
PAGE = 16


def worker_jax(model_dir: str, lengths: list[int], repeats: int, devices: int, dtype: str,
               settings: dict | None = None) -> dict:
    """Times Engine.generate and the bare forward per length, one engine per length (one
    token bucket = the prompt, so neither side pays for padding)."""
    import jax
    import numpy as np

    from jaxfill.engine.engine import Engine
    from jaxfill.engine.request import SamplingParams
    from jaxfill.models.forward import forward
    from jaxfill.models.kv_cache import single_sequence_metadata

    rng = np.random.default_rng(0)
    out = {"jax": jax.__version__, "dtype": dtype, "lengths": {}}  # no device query before the Engine
    for n in lengths:
        overrides = {"engine.max_num_batched_tokens": n, "engine.token_buckets": [n],
                     "engine.max_num_seqs": 1, "engine.seq_buckets": [1],
                     "engine.num_pages": n // PAGE + 8, "engine.max_model_len": n + PAGE,
                     "model.dtype": dtype, **(settings or {})}
        if devices:  # else the engine's CPU default
            overrides["mesh.tensor"] = devices
        engine = Engine.from_config("bench", model_path=model_dir, overrides=overrides, progress=False)
        params = SamplingParams(max_tokens=1, temperature=0.0)
        runner = engine.runner
        meta = single_sequence_metadata(n, 0, list(range(1, n // PAGE + 2)), PAGE)
        positions = np.arange(n, dtype=np.int32)

        def bare():
            tokens = rng.integers(0, 32000, size=n).astype(np.int32)
            with runner.mesh_context():
                logits, runner.kv_cache = forward(runner.graphdef, runner.state, tokens, positions,
                                                  runner.kv_cache, meta)
            return np.asarray(logits)

        def through_engine():  # a fresh prompt each call: no prefix-cache hit from the last one
            (c,) = engine.generate([rng.integers(0, 32000, size=n).tolist()], params)
            assert len(c.token_ids) == 1, c
            return c

        gen_t, bare_t, gen_cpu, bare_cpu = [], [], [], []
        for i in range(repeats + 1):  # first of each: warm-up (compiles the bare forward)
            for fn, ts, cpu in ((through_engine, gen_t, gen_cpu), (bare, bare_t, bare_cpu)):
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                if i:
                    ts.append(time.perf_counter() - t0)
                    cpu.append(time.process_time() - c0)
        out["devices"], out["mesh_tensor"] = len(jax.devices()), engine.config.mesh.tensor
        out["lengths"][str(n)] = {"generate_s": gen_t, "bare_forward_s": bare_t, "generate_cpu_s": gen_cpu,
                                  "bare_forward_cpu_s": bare_cpu, "attention_impl": engine.stats()["attention_impl"]}
        print(f"jax devices={devices} {dtype} len={n}: generate "
              + " ".join(f"{t * 1e3:.0f}" for t in gen_t) + " ms; bare "
              + " ".join(f"{t * 1e3:.0f}" for t in bare_t) + " ms", file=sys.stderr, flush=True)
        engine.close()
    return out


def parse_settings(pairs: list[str]) -> dict:
    """--set KEY=JSON pairs -> overrides (a value that is not JSON stays a string)."""
    out = {}
    for kv in pairs:
        key, _, raw = kv.partition("=")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def fmt_ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f} ms"


def run(cmd: list[str], env=None) -> dict:
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def jax_run(model_dir, lengths, repeats, devices, dtype, pin, settings: list[str]) -> dict:
    env = dict(os.environ)
    if devices:  # 0: the engine's CPU default chooses
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}").strip()
    return run(pin + [sys.executable, os.path.abspath(__file__), "--worker", model_dir, "--lengths",
                *map(str, lengths), "--repeats", str(repeats), "--devices", str(devices),
                "--dtypes", dtype, *(a for kv in settings for a in ("--set", kv))], env)


def hf_run(model_dir, lengths, repeats, threads, dtype, pin) -> dict:
    return run(pin + [sys.executable, HF_WORKER, "time", model_dir, "--lengths", *map(str, lengths),
                "--repeats", str(repeats), "--threads", str(threads), "--dtype", dtype])


def summarize(runs, dtypes, lengths, devices, pin) -> list[dict]:
    """Medians over all timed calls of all rounds (CPU seconds when pinned, else wall)."""
    med = statistics.median
    rows = []
    for dtype in dtypes:
        for n in lengths:
            hf_key = "cpu_times" if pin else "lengths"  # pinned: CPU seconds, else wall seconds
            hf = med([t for r in runs[("hf", 0, dtype)] for t in r[hf_key][str(n)]])
            for dev in devices:
                rs = [r["lengths"][str(n)] for r in runs[("jax", dev, dtype)]]
                gen = med([t for r in rs for t in r["generate_cpu_s" if pin else "generate_s"]])
                bare = med([t for r in rs for t in r["bare_forward_cpu_s" if pin else "bare_forward_s"]])
                rows.append({"dtype": dtype, "prompt_len": n, "devices": dev, "hf_ttft_s": hf,
                             "generate_ttft_s": gen, "bare_forward_s": bare,
                             "generate_over_hf_speed": hf / gen, "bare_over_hf_speed": hf / bare,
                             "generate_overhead": gen / bare - 1, "hf_tok_s": n / hf, "generate_tok_s": n / gen,
                             "attention_impl": rs[0]["attention_impl"],
                             "mesh_tensor": runs[("jax", dev, dtype)][0].get("mesh_tensor")})
    return rows


def two_core_rows(runs, dtypes, lengths, devices, min_ratio: float = 1.8) -> list[dict]:
    """Medians over only the calls that had both cores: CPU time / wall >= min_ratio.

    On a shared 2-core machine a process often gets one core; then jaxfill's wall time is
    its one-core time and HF's 2 OpenMP threads spin-wait (2-7x slower). Calls that got
    two cores are the ones that answer "how do the two compare on 2 cores"."""
    med = statistics.median
    out = []
    for dtype in dtypes:
        for n in lengths:
            hf = [w for r in runs[("hf", 0, dtype)] for w, c in zip(r["lengths"][str(n)], r["cpu_times"][str(n)])
                  if c / w >= min_ratio]
            row = {"dtype": dtype, "prompt_len": n, "hf_s": med(hf) if hf else None, "hf_calls": len(hf)}
            for dev in devices:
                rs = [r["lengths"][str(n)] for r in runs[("jax", dev, dtype)]]
                js = [w for r in rs for w, c in zip(r["bare_forward_s"], r["bare_forward_cpu_s"]) if c / w >= min_ratio]
                js += [w for r in rs for w, c in zip(r["generate_s"], r["generate_cpu_s"]) if c / w >= min_ratio]
                row[f"jax_{dev}dev_s"] = med(js) if js else None
                row[f"jax_{dev}dev_calls"] = len(js)
            out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048, 8192])
    p.add_argument("--devices", type=int, nargs="+", default=[0, 1],
                   help="XLA CPU devices per jaxfill run (mesh.tensor = N); 0: the engine's CPU default")
    p.add_argument("--dtypes", nargs="+", default=["float32"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--pin", type=int, metavar="CORE", default=None,
                   help="per-core efficiency instead: every process pinned to CORE (taskset), HF 1 thread, "
                        "jaxfill 1 device; compares process CPU time, which other jobs on the machine "
                        "disturb far less than wall time")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--arch", default="llama", help="family of the bench-shape checkpoint (prefill_hf_worker.py)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="an engine setting for every jaxfill run, e.g. engine.enable_prefix_caching=false")
    p.add_argument("--worker", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    p.add_argument("--two-core", metavar="JSON", help="print the two-core table of a finished run's JSON")
    args = p.parse_args()
    if args.two_core:
        with open(args.two_core) as f:
            done = json.load(f)
        runs = {(w, int(n), d): r for w, n, d in (k.split("/") for k in done["raw"]) for r in [done["raw"][f"{w}/{n}/{d}"]]}
        dtypes = sorted({d for _, _, d in runs})
        lengths = sorted({int(n) for r in done["raw"].values() for n in r[0]["lengths"]})
        devices = sorted({n for w, n, _ in runs if w == "jax"})
        for r in two_core_rows(runs, dtypes, lengths, devices):
            print(f"{r['dtype']} {r['prompt_len']}: HF {fmt_ms(r['hf_s'])} (n={r['hf_calls']}); " + "; ".join(
                f"jaxfill {d} dev {fmt_ms(r[f'jax_{d}dev_s'])} (n={r[f'jax_{d}dev_calls']})" for d in devices))
        return
    if args.worker:
        print(json.dumps(worker_jax(args.worker, args.lengths, args.repeats, args.devices[0], args.dtypes[0],
                                    parse_settings(args.set))))
        return

    pin = [] if args.pin is None else ["taskset", "-c", str(args.pin)]
    if pin:
        args.threads, args.devices = 1, [1]  # the default would see the one pinned core too
    load_start, t0 = os.getloadavg(), time.time()
    variants = [("hf", 0, d) for d in args.dtypes] + [("jax", n, d) for d in args.dtypes for n in args.devices]
    runs = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as work:
        model_dir = os.path.join(work, "bench_hf")
        subprocess.run([sys.executable, HF_WORKER, "save", model_dir, "--arch", args.arch], check=True, cwd=ROOT)
        for i in range(args.rounds):
            for v in (variants if i % 2 == 0 else variants[::-1]):
                who, n, dtype = v
                runs[v].append(hf_run(model_dir, args.lengths, args.repeats, args.threads, dtype, pin) if who == "hf"
                               else jax_run(model_dir, args.lengths, args.repeats, n, dtype, pin, args.set))
            print(f"round {i + 1}/{args.rounds} done, {time.time() - t0:.0f}s", file=sys.stderr, flush=True)

    rows = summarize(runs, args.dtypes, args.lengths, args.devices, pin)
    two_core = two_core_rows(runs, args.dtypes, args.lengths, args.devices) if not pin else []
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "arch": args.arch,
              "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
              "load_average_start": load_start, "load_average_end": os.getloadavg(),
              "rounds": args.rounds, "repeats": args.repeats, "threads_hf": args.threads,
              "settings": parse_settings(args.set),
              "measure": "process CPU time, one pinned core" if pin else "wall time",
              "rows": rows, "two_core_rows": two_core, "raw": {f"{w}/{n}/{d}": r for (w, n, d), r in runs.items()},
              "wall_s": time.time() - t0}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{result['measure']}:")
    print("| dtype | tokens | XLA devices | transformers TTFT | Engine.generate TTFT | bare forward | "
          "generate speed / HF | bare / HF | engine overhead |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        dev = f"default: {r['mesh_tensor']}" if r["devices"] == 0 else r["devices"]
        print(f"| {r['dtype']} | {r['prompt_len']} | {dev} | {r['hf_ttft_s'] * 1e3:.0f} ms | "
              f"{r['generate_ttft_s'] * 1e3:.0f} ms | {r['bare_forward_s'] * 1e3:.0f} ms | "
              f"{r['generate_over_hf_speed']:.2f}x | {r['bare_over_hf_speed']:.2f}x | {r['generate_overhead'] * 100:+.1f}% |")
    if two_core:
        print("wall time of the calls that had both cores (CPU / wall >= 1.8; jaxfill: generate and bare "
              "forward together; n = calls):")
        for r in two_core:
            print(f"  {r['dtype']} {r['prompt_len']}: HF {fmt_ms(r['hf_s'])} (n={r['hf_calls']}); " + "; ".join(
                f"jaxfill {d} dev {fmt_ms(r[f'jax_{d}dev_s'])} (n={r[f'jax_{d}dev_calls']})" for d in args.devices))
    print(f"load average {load_start[0]:.1f} -> {os.getloadavg()[0]:.1f}; wrote {os.path.relpath(args.out, ROOT)}")


if __name__ == "__main__":
    main()
