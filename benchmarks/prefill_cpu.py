"""Prefill tokens/s of jaxfill vs Hugging Face transformers on the same weights, on CPU.

    python benchmarks/prefill_cpu.py [--lengths 128 512 2048 8192] [--repeats 3] [--rounds 2]

The bench shape (configs/bench.toml: hidden 512, intermediate 1408, 8 layers, 8 heads,
2 KV heads, vocab 32000) is saved once as a random-init HF LlamaForCausalLM
(`save_pretrained`, f32) to a temp dir. Each round then times, each framework in its
own fresh process (so neither inherits the other's threads or allocator):

* transformers: benchmarks/prefill_hf_worker.py, f32, attn_implementation="sdpa",
  logits_to_keep=1, torch.set_num_threads(2);
* jaxfill: `jaxfill bench prefill --config bench --model DIR` (weights loaded by
  models.checkpoint.load_hf_params; the jitted forward through engine.simple.prefill_chunks
  on a KVCache sized for the prompt; attention impl "auto" = the fastest registered).

Every run is one whole-prompt prefill after one warm-up (compile) run; the reported TTFT
is the median of all timed runs over all rounds, and rounds alternate which framework
goes first so drifting load on a shared machine hits both. Writes
benchmarks/results/prefill_cpu.json and prefill_cpu.md.
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
WORKER = os.path.join(ROOT, "benchmarks", "prefill_hf_worker.py")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run(cmd: list[str]) -> str:
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if proc.returncode:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}")
    return proc.stdout


def hf_round(model_dir: str, lengths: list[int], repeats: int, threads: int) -> dict:
    out = run([sys.executable, WORKER, "time", model_dir, "--lengths", *map(str, lengths),
               "--repeats", str(repeats), "--threads", str(threads)])
    return json.loads(out.strip().splitlines()[-1])


def jax_round(model_dir: str, lengths: list[int], repeats: int, work: str, i: int) -> dict:
    run([sys.executable, "-m", "jaxfill.serving.cli", "bench", "prefill", "--config", "bench", "--model", model_dir,
         "--lengths", *map(str, lengths), "--repeats", str(repeats), "--hardware", "none",
         "--out", work, "--name", f"jax_round{i}", "--no-plots"])
    with open(os.path.join(work, f"jax_round{i}.json")) as f:
        return json.load(f)


def markdown(result: dict) -> str:
    lines = [
        f"# Prefill on CPU: jaxfill vs transformers ({result['date'][:10]})",
        "",
        f"Bench shape (hidden 512, intermediate 1408, 8 layers, 8 q / 2 kv heads, head_dim 64, vocab 32000), "
        f"random-init HF checkpoint, f32, same weights in both. Machine: {result['machine']['cpu_count']} CPU "
        f"cores ({result['machine']['processor']}), shared and noisy (±25%); load average {result['load_average_start'][0]:.1f} at start, {result['load_average_end'][0]:.1f} at end. jaxfill attention impl: "
        f"`{result['jaxfill']['attention_impl']}`; transformers {result['hf']['transformers']} / torch "
        f"{result['hf']['torch']}, sdpa, logits_to_keep=1, {result['hf']['threads']} threads. "
        f"Median of {result['runs_per_point']} timed runs per point ({result['rounds']} rounds x "
        f"{result['repeats']} repeats, each framework in its own process, after a warm-up run).",
        "",
        "| prompt tokens | jaxfill TTFT | jaxfill tok/s | transformers TTFT | transformers tok/s | jaxfill / HF |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['prompt_len']} | {r['jaxfill_ttft_s'] * 1e3:.0f} ms | {r['jaxfill_tokens_per_s']:,.0f} | "
                     f"{r['hf_ttft_s'] * 1e3:.0f} ms | {r['hf_tokens_per_s']:,.0f} | {r['speedup']:.2f}x |")
    lines += ["", "Reproduce: `python benchmarks/prefill_cpu.py` (writes benchmarks/results/prefill_cpu.{json,md}).", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048, 8192])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--wait-for-quiet", type=float, default=0, metavar="SECONDS",
                   help="first wait up to SECONDS for the 1-minute load average to drop below the core count")
    args = p.parse_args()
    if args.wait_for_quiet:
        deadline = time.time() + args.wait_for_quiet
        while os.getloadavg()[0] >= os.cpu_count() and time.time() < deadline:
            print(f"load average {os.getloadavg()[0]:.1f}; waiting for a quieter machine...", file=sys.stderr,
                  flush=True)
            time.sleep(15)
    load_start = os.getloadavg()
    t0 = time.time()
    with tempfile.TemporaryDirectory() as work:
        model_dir = os.path.join(work, "bench_hf")
        run([sys.executable, WORKER, "save", model_dir])
        hf_runs, jax_runs = [], []
        for i in range(args.rounds):
            order = ["hf", "jax"] if i % 2 == 0 else ["jax", "hf"]
            for who in order:
                if who == "hf":
                    hf_runs.append(hf_round(model_dir, args.lengths, args.repeats, args.threads))
                else:
                    jax_runs.append(jax_round(model_dir, args.lengths, args.repeats, work, i))
            print(f"round {i + 1}/{args.rounds} done, {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    rows = []
    for n in args.lengths:
        hf_t = [t for r in hf_runs for t in r["lengths"][str(n)]]
        jx_t = [t for r in jax_runs for p in r["points"] if p["prompt_len"] == n and p["chunk"] == 0
                for t in p["times_s"]]
        hf_med, jx_med = statistics.median(hf_t), statistics.median(jx_t)
        rows.append({"prompt_len": n, "jaxfill_ttft_s": jx_med, "jaxfill_tokens_per_s": n / jx_med,
                     "hf_ttft_s": hf_med, "hf_tokens_per_s": n / hf_med, "speedup": hf_med / jx_med,
                     "jaxfill_times_s": jx_t, "hf_times_s": hf_t})
    import jax

    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpu_count": os.cpu_count(), "processor": cpu_model(),
                    "platform": platform.platform()},
        "shape": "configs/bench.toml", "dtype": "float32", "lengths": args.lengths,
        "repeats": args.repeats, "rounds": args.rounds, "runs_per_point": args.repeats * args.rounds,
        "jaxfill": {"attention_impl": jax_runs[0]["attention_impl"], "jax": jax.__version__},
        "hf": {k: hf_runs[0][k] for k in ("torch", "transformers", "threads", "attn_implementation")},
        "rows": rows,
        "wall_s": time.time() - t0,
        # Other jobs on the machine during the run (1/5/15-minute load averages).
        "load_average_start": load_start, "load_average_end": os.getloadavg(),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "prefill_cpu.json"), "w") as f:
        json.dump(result, f, indent=1)
    md = markdown(result)
    with open(os.path.join(args.out, "prefill_cpu.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
