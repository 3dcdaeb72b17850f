"""Multi-head latent attention (issue 26): the cache it saves, and its CPU prefill.

    python benchmarks/mla.py [--lengths 512 2048] [--repeats 5] [--rounds 1]
    python benchmarks/mla.py --replot      # redraw the PNG from the JSON
    python benchmarks/mla.py --plan-only   # part 1 only (no compute)

1. Planner (no compute; engine/planner/plan.py's plan_prefill, as `jaxfill plan --json`): KV
   bytes per token and how many 32k-token requests fit beside the weights, DeepSeek V3
   (configs/deepseek_v3.toml) vs Llama-3-70B (configs/llama3_70b.toml, its 8k position
   limit raised to 128k as in Llama 3.1: same shape, same KV bytes), on H100 and TPU v5e
   at the smallest mesh the planner shows each fitting on (the cache holds the latent
   once: K-only pages, pallas_kernels/kv_cache.py).
2. CPU prefill, jaxfill vs transformers on the same random-init DeepSeek V3 checkpoint
   (tests/hf_models.py make_hf_checkpoint, a small shape), each framework in its own
   process: jaxfill one request through `Engine.generate(max_tokens=1)` (TTFT, compile
   excluded by a warm-up), transformers `benchmarks/prefill_hf_worker.py time` (f32,
   AutoModelForCausalLM, logits_to_keep=1, 2 threads). Medians of --repeats x --rounds.

Writes benchmarks/results/mla.json and mla.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
WORKER = os.path.join(ROOT, "benchmarks", "prefill_hf_worker.py")
PROMPT = 32768
LLAMA_LONG = {"model.max_position_embeddings": 131072}  # Llama 3.1's limit; the preset is Llama 3 (8k)
# (model, hardware, mesh overrides): the smallest mesh where the planner fits one 32k
# request today (DeepSeek V3 on v5e: the largest mesh it accepts, 128 = num_heads, fits none
# today), plus one 8-GPU node for Llama-3-70B and 64 H100s for DeepSeek V3 for scale.
PLAN_ROWS = [
    ("deepseek_v3", "h100", {"mesh.expert": 32}),
    ("deepseek_v3", "h100", {"mesh.expert": 64}),
    ("deepseek_v3", "tpu_v5e", {"mesh.expert": 128}),
    ("llama3_70b", "h100", {"mesh.tensor": 2}),
    ("llama3_70b", "h100", {"mesh.tensor": 8}),
    ("llama3_70b", "tpu_v5e", {"mesh.tensor": 16}),
]
# the small DeepSeek V3 of part 2 (make_hf_checkpoint kwargs over tests/hf_models.py's deepseek_v3)
CKPT = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=64,
            q_lora_rank=96, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, moe_intermediate_size=128,
            num_hidden_layers=4, vocab_size=2048, max_position_embeddings=4096)


def planner_rows() -> list[dict]:
    from jaxfill.engine.config import load_config
    from jaxfill.engine.planner.hardware import load_hardware
    from jaxfill.engine.planner.plan import plan_prefill

    rows = []
    for cfg, hw_name, mesh in PLAN_ROWS:
        over = {**mesh, "engine.max_model_len": 2 * PROMPT, **(LLAMA_LONG if cfg == "llama3_70b" else {})}
        config, hw = load_config(cfg, over), load_hardware(hw_name)
        r = plan_prefill(config, hw, PROMPT)
        devices = config.mesh.size
        base = {"config": cfg, "hardware": hw.name, "mesh": mesh, "devices": devices, "overrides": over,
                "weight_gb_per_device": r["weight_bytes_per_device"] / 1e9,
                "free_gb_per_device": r["free_bytes_per_device"] / 1e9}
        rows.append({**base, "kv_bytes_per_token": r["kv_bytes_per_token"],
                     "kv_bytes_per_token_per_device": r["kv_bytes_per_token_per_device"],
                     "kv_gb_per_32k_request_per_device": r["kv_bytes_per_request_per_device"] / 1e9,
                     "max_concurrent_32k_requests": r["max_concurrent_requests"]})
        print(f"plan {cfg} on {devices} x {hw.name}: {r['kv_bytes_per_token']:,} B/token, "
              f"{r['max_concurrent_requests']} x 32k fit", file=sys.stderr, flush=True)
    return rows


def jax_worker(model_dir: str, lengths: list[int], repeats: int, seed: int) -> None:
    """One process: Engine on the checkpoint, warm-up, then `repeats` TTFTs per length (JSON on stdout)."""
    import numpy as np

    from jaxfill import Engine, SamplingParams

    top = max(lengths)
    over = {"engine.max_num_batched_tokens": top, "engine.token_buckets": sorted(lengths),
            "engine.max_model_len": 2 * top, "engine.num_pages": 2 * (top // 16 + 2) + 1,
            "engine.enable_prefix_caching": False, "engine.max_num_seqs": 4}
    t = time.perf_counter()
    e = Engine.from_config("tiny", model_path=model_dir, overrides=over, progress=False)
    start_s = time.perf_counter() - t
    rng = np.random.default_rng(seed)
    vocab = e.config.model.vocab_size
    out = {"framework": "jaxfill", "overrides": over, "start_s": start_s, "lengths": {},
           "mesh": {k: getattr(e.config.mesh, k) for k in ("data", "tensor", "expert", "sequence", "stage")},
           "attention_impl": e.config.engine.attention_impl, "dtype": str(e.config.model.dtype)}
    for n in lengths:
        times = []
        for i in range(repeats + 1):  # the first is a warm-up (caches, any late compile)
            prompt = [int(x) for x in rng.integers(0, vocab, n)]
            t = time.perf_counter()
            e.generate([prompt], SamplingParams(max_tokens=1))
            if i:
                times.append(time.perf_counter() - t)
        print(f"jaxfill len={n}: " + " ".join(f"{x * 1e3:.0f}" for x in times) + " ms", file=sys.stderr, flush=True)
        out["lengths"][str(n)] = times
    print(json.dumps(out))


def run_json(cmd: list[str]) -> dict:
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if proc.returncode:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def prefill(args) -> dict:
    sys.path.insert(0, ROOT)
    from tests.hf_models import make_hf_checkpoint

    lens = [str(n) for n in args.lengths]
    hf_runs, jax_runs = [], []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as work:
        model_dir = make_hf_checkpoint(os.path.join(work, "dsv3"), "deepseek_v3", **CKPT)
        for i in range(args.rounds):
            for who in (["hf", "jax"] if i % 2 == 0 else ["jax", "hf"]):
                if who == "hf":
                    hf_runs.append(run_json([sys.executable, WORKER, "time", model_dir, "--lengths", *lens,
                                             "--repeats", str(args.repeats), "--threads", str(args.threads)]))
                else:
                    jax_runs.append(run_json([sys.executable, __file__, "--worker-jax", model_dir, "--lengths", *lens,
                                              "--repeats", str(args.repeats), "--seed", str(i)]))
            print(f"round {i + 1}/{args.rounds} done, {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
        with open(os.path.join(model_dir, "config.json")) as f:
            hf_config = json.load(f)
    rows = summarize([{"prompt_len": int(n), "jaxfill_times_s": [t for r in jax_runs for t in r["lengths"][n]],
                       "hf_times_s": [t for r in hf_runs for t in r["lengths"][n]],
                       "jaxfill_round_times_s": [r["lengths"][n] for r in jax_runs],
                       "hf_round_times_s": [r["lengths"][n] for r in hf_runs]} for n in lens])
    keep = ("hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
            "qk_nope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
            "n_shared_experts", "first_k_dense_replace", "vocab_size")
    return {"checkpoint_kwargs": CKPT, "hf_config": {k: hf_config.get(k) for k in keep},
            "jaxfill": {k: jax_runs[0][k] for k in ("mesh", "attention_impl", "dtype", "overrides")},
            "jaxfill_start_s": [r["start_s"] for r in jax_runs],
            "hf": {k: hf_runs[0][k] for k in ("torch", "transformers", "threads", "attn_implementation", "dtype")},
            "repeats": args.repeats, "rounds": args.rounds, "rows": rows, "wall_s": time.time() - t0}


def summarize(rows: list[dict]) -> list[dict]:
    """Medians (what the section quotes) and minima (least touched by other jobs) of the timed runs."""
    for r in rows:
        jx, hf, n = r["jaxfill_times_s"], r["hf_times_s"], r["prompt_len"]
        r.update({"jaxfill_ttft_s": statistics.median(jx), "hf_ttft_s": statistics.median(hf),
                  "jaxfill_min_s": min(jx), "hf_min_s": min(hf)})
        r.update({"hf_over_jaxfill": r["hf_ttft_s"] / r["jaxfill_ttft_s"],
                  "hf_over_jaxfill_min": r["hf_min_s"] / r["jaxfill_min_s"],
                  "jaxfill_tokens_per_s": n / r["jaxfill_ttft_s"], "hf_tokens_per_s": n / r["hf_ttft_s"]})
    return rows


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = result["plan"]
    short = {"deepseek_v3": "DSV3", "llama3_70b": "L3-70B", "h100_sxm": "H100", "tpu_v5e": "v5e"}
    labels = [f"{short.get(r['config'], r['config'])}\n{r['devices']}x{short.get(r['hardware'], r['hardware'])}"
              for r in rows]
    xs = range(len(rows))
    colors = ["tab:blue" if r["config"] == "deepseek_v3" else "tab:orange" for r in rows]
    left.bar(xs, [r["max_concurrent_32k_requests"] for r in rows], color=colors)
    for x, r in zip(xs, rows):
        left.annotate(f"{r['kv_bytes_per_token'] / 1024:.0f} KiB/tok", (x, r["max_concurrent_32k_requests"]),
                      ha="center", va="bottom", fontsize=6)
    left.set_xticks(list(xs), labels, fontsize=7)
    left.set_ylabel("32k-token requests that fit beside the weights")
    left.set_title("planner, bf16", fontsize=9)
    if result.get("prefill"):
        pr = result["prefill"]["rows"]
        n = [r["prompt_len"] for r in pr]
        right.plot(n, [r["jaxfill_ttft_s"] * 1e3 for r in pr], "o-", label="jaxfill (Engine, MLA form auto)")
        right.plot(n, [r["hf_ttft_s"] * 1e3 for r in pr], "s--", label="transformers f32")
        for r in pr:
            right.annotate(f"HF/jaxfill {r['hf_over_jaxfill']:.2f}x", (r["prompt_len"], r["jaxfill_ttft_s"] * 1e3),
                           fontsize=8, va="bottom")
        right.set_xscale("log", base=2)
        right.set_yscale("log")
        right.set_xlabel("prompt tokens")
        right.set_ylabel("prefill / TTFT, ms (median)")
        right.set_title("small random DeepSeek V3, CPU (2 cores, noisy)", fontsize=9)
        right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plan-only", action="store_true")
    p.add_argument("--replot", action="store_true", help="redraw the PNG from the saved JSON")
    p.add_argument("--worker-jax", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("--out", default=os.path.join(RESULTS, "mla.json"))
    args = p.parse_args()
    png = os.path.splitext(args.out)[0] + ".png"
    if args.worker_jax:
        return jax_worker(args.worker_jax, args.lengths, args.repeats, args.seed)
    if args.replot:
        with open(args.out) as f:
            result = json.load(f)
        if result.get("prefill"):  # recompute the summaries from the stored times
            summarize(result["prefill"]["rows"])
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        return plot(result, png)
    load_start = os.getloadavg()
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu_count": os.cpu_count(), "prompt_len": PROMPT,
              "plan": planner_rows()}
    if not args.plan_only:
        result["prefill"] = prefill(args)
    result["load_average_start"], result["load_average_end"] = load_start, os.getloadavg()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, png)
    print(json.dumps({"plan": [{k: r[k] for k in ("config", "hardware", "devices", "kv_bytes_per_token",
                                                  "max_concurrent_32k_requests")} for r in result["plan"]],
                      "prefill": [{k: r[k] for k in ("prompt_len", "jaxfill_ttft_s", "hf_ttft_s", "hf_over_jaxfill",
                                                     "hf_over_jaxfill_min")}
                                  for r in result.get("prefill", {}).get("rows", [])]}, indent=1))


if __name__ == "__main__":
    main()
