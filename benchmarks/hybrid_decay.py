"""The seed's decay coefficient, TTFT(2S) / TTFT(S), for a linear-attention hybrid and a
full-attention model of the same shape (issue 27), or (`--pair dsa`, issue 45) for DeepSeek
sparse attention and dense MLA of the same shape.

    python benchmarks/hybrid_decay.py [--pair hybrid|dsa] [--lengths 2048 4096 8192 16384] [--repeats 3]
    python benchmarks/hybrid_decay.py --replot

`--pair dsa`: DeepSeek V3.2-shaped (`DeepseekV32ForCausalLM`), 4 layers of hidden 256, 8
heads over a 64-wide latent + 16 roped dims, dense MLPs; the sparse model's indexer has 4
heads of 32 and keeps the top 256 keys per query, the dense one (index_topk 0) attends
every causal key. Writes benchmarks/results/dsa_decay.json and .png.

Both are Qwen3.5-family models with random weights (`Engine.from_config("tiny", overrides=
{model.architecture = Qwen3_5ForCausalLM, ...})`), 8 layers of hidden 256: the hybrid
with Qwen3.5's 3:1 pattern (layers 3 and 7 gated full attention, the rest Gated
DeltaNet), the other with every layer full attention. f32, one CPU device, chunked
prefill with a 2048-token budget, prefix caching off. TTFT: one
request through `Engine.generate(max_tokens=1)`, compile excluded by a warm-up per
length, median of --repeats. Each model in its own process, one after the other. Memory
per request: its pages at the allocated bytes per token plus one state slot (Engine.stats).

Writes benchmarks/results/hybrid_decay.json and hybrid_decay.png.
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
RESULTS = os.path.join(ROOT, "benchmarks", "results")
SHAPE = {"model.architecture": "Qwen3_5ForCausalLM", "model.hidden_size": 256, "model.intermediate_size": 688,
         "model.num_layers": 8, "model.num_heads": 8, "model.num_kv_heads": 2, "model.head_dim": 32,
         "model.rotary_dim": 8, "model.vocab_size": 512, "model.qk_norm": "head", "model.norm_kind": "rms_one_plus",
         "model.attn_output_gate": True, "model.linear_num_key_heads": 4, "model.linear_num_value_heads": 8,
         "model.linear_key_head_dim": 32, "model.linear_value_head_dim": 32, "model.bos_token_id": None,
         "model.eos_token_id": []}
MODELS = {"hybrid (3 DeltaNet : 1 attention)": {"model.linear_layers": [0, 1, 2, 4, 5, 6]},
          "full attention": {"model.linear_layers": []}}
DSA_SHAPE = {"model.architecture": "DeepseekV32ForCausalLM", "model.hidden_size": 256, "model.intermediate_size": 688,
             "model.num_layers": 4, "model.num_heads": 8, "model.num_kv_heads": 1, "model.kv_lora_rank": 64,
             "model.q_lora_rank": 96, "model.qk_nope_head_dim": 32, "model.qk_rope_head_dim": 16,
             "model.v_head_dim": 32, "model.rotary_dim": 16, "model.rope_interleave": True,
             "model.index_n_heads": 4, "model.index_head_dim": 32, "model.vocab_size": 512,
             "model.bos_token_id": None, "model.eos_token_id": []}
DSA_MODELS = {"sparse (top 256 keys)": {"model.index_topk": 256, "model.head_dim": 64 + 16 + 32},
              "dense MLA": {"model.index_topk": 0, "model.head_dim": 64 + 16}}
PAIRS = {"hybrid": (SHAPE, MODELS), "dsa": (DSA_SHAPE, DSA_MODELS)}


def worker(pair: str, name: str, lengths: list[int], repeats: int) -> None:
    import numpy as np

    from jaxfill import Engine, SamplingParams
    from jaxfill.models.families.registry import param_count

    top = max(lengths)
    shape, models = PAIRS[pair]
    over = {**shape, **models[name], "model.max_position_embeddings": 2 * top,
            "engine.max_num_batched_tokens": 2048, "engine.token_buckets": [2048], "engine.max_model_len": 2 * top,
            "engine.num_pages": top // 16 + 8, "engine.enable_prefix_caching": False, "engine.max_num_seqs": 2,
            "mesh.cpu_split": False}
    e = Engine.from_config("tiny_random", overrides=over, progress=False)
    rng = np.random.default_rng(0)
    st = e.stats()  # allocation, read from the cache's arrays: pages by the token, states by the slot
    per_slot = st["state_bytes"] // e.config.engine.state_pool_slots if e.config.model.linear.layers else 0
    out = {"model": name, "params": param_count(e.config.model), "lengths": {}, "bytes_per_request": {
        str(n): -(-n // 16) * 16 * st["kv_bytes_per_token"] + per_slot for n in lengths}}
    for n in lengths:
        times = []
        for i in range(repeats + 1):  # the first: compile and warm-up
            prompt = [int(x) for x in rng.integers(3, 500, n)]
            t = time.perf_counter()
            e.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
            if i:
                times.append(time.perf_counter() - t)
        print(f"{name} S={n}: " + " ".join(f"{x:.2f}" for x in times) + " s", file=sys.stderr, flush=True)
        out["lengths"][str(n)] = times
    print(json.dumps(out))


def summarize(runs: list[dict], lengths: list[int]) -> list[dict]:
    rows = []
    for r in runs:
        med = [statistics.median(r["lengths"][str(n)]) for n in lengths]
        rows.append({"model": r["model"], "params": r["params"], "ttft_s": dict(zip(map(str, lengths), med)),
                     "bytes_per_request": r["bytes_per_request"],
                     "decay": {f"{a}->{b}": mb / ma for a, b, ma, mb in zip(lengths, lengths[1:], med, med[1:])}})
    return rows


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right, mem) = plt.subplots(1, 3, figsize=(15, 4.2))
    lengths = result["lengths"]
    for row in result["rows"]:
        left.plot(lengths, [row["ttft_s"][str(n)] for n in lengths], "o-", label=row["model"])
        right.plot(lengths[1:], list(row["decay"].values()), "o-", label=row["model"])
        mem.plot(lengths, [row["bytes_per_request"][str(n)] / 2**20 for n in lengths], "o-", label=row["model"])
    mem.set_xscale("log", base=2)
    mem.set_yscale("log")
    mem.set_xlabel("prompt tokens S")
    mem.set_ylabel("KV pages + state per request, MiB")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("prompt tokens S")
    left.set_ylabel("TTFT, s (median)")
    left.legend(fontsize=8)
    right.axhline(2, color="gray", lw=0.8, ls="--")
    right.axhline(4, color="gray", lw=0.8, ls=":")
    right.set_xscale("log", base=2)
    right.set_xlabel("S (the doubling ends here)")
    right.set_ylabel("TTFT(S) / TTFT(S/2)")
    right.set_title("2 = linear, 4 = quadratic", fontsize=9)
    shape = {"hybrid": "8-layer hidden-256 Qwen3.5-shaped", "dsa": "4-layer hidden-256 DeepSeek V3.2-shaped"}
    fig.suptitle(f"{shape[result.get('pair', 'hybrid')]} models, f32, one XLA:CPU device (2 cores, noisy)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pair", choices=sorted(PAIRS), default="hybrid")
    p.add_argument("--replot", action="store_true")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out")
    args = p.parse_args()
    args.out = args.out or os.path.join(RESULTS, f"{args.pair}_decay.json")
    shape, models = PAIRS[args.pair]
    png = os.path.splitext(args.out)[0] + ".png"
    if args.worker:
        return worker(args.pair, args.worker, args.lengths, args.repeats)
    if args.replot:
        with open(args.out) as f:
            return plot(json.load(f), png)
    t0, load_start = time.time(), os.getloadavg()
    runs = []
    for name in models:
        cmd = [sys.executable, __file__, "--pair", args.pair, "--worker", name, "--lengths", *map(str, args.lengths),
               "--repeats", str(args.repeats)]
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        if proc.returncode:
            raise SystemExit(f"worker {name!r} failed ({proc.returncode})")
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"{name} done, {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "lengths": args.lengths, "repeats": args.repeats,
              "pair": args.pair, "shape": shape, "runs": runs, "rows": summarize(runs, args.lengths), "wall_s": time.time() - t0,
              "load_average_start": load_start, "load_average_end": os.getloadavg()}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, png)
    print(json.dumps(result["rows"], indent=1))


if __name__ == "__main__":
    main()
