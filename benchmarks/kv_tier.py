"""The host/disk KV tier (issue 29), measured on this machine in one run:

1. save and restore bandwidth per block size: engine/kv_tier/page_offload.py's gather + host copy
   and host -> device + scatter, for a tiny, the bench and a Llama-3-8B-shaped page;
2. a RAG-shaped workload through `jaxfill bench serve` (16 documents of 2k tokens, a
   device pool that holds 4, questions drawn Zipf over the documents): TTFT p50/p99 and
   prompt tokens actually prefilled, tier off vs host vs host + disk;
3. the hit rate below which the tier does not pay: a save costs s per page whether or
   not the page comes back, a hit saves c - r (prefill minus restore), so the tier pays
   above h = s / (c - r).

    python benchmarks/kv_tier.py [--quick]  -> benchmarks/results/kv_tier.json, kv_tier.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
# (name, layers, KV heads, head dim, dtype) of one page of 16 tokens
LAYOUTS = [("tiny", 4, 2, 32, "float32"), ("bench", 8, 2, 64, "float32"), ("llama3-8b", 32, 8, 128, "bfloat16")]
PAGES_PER_CALL = (1, 8, 64)


def bandwidth(reps: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    from jaxfill.engine.kv_tier.host import KVBlock
    from jaxfill.engine.kv_tier.page_offload import gather_blocks, scatter_blocks

    rows = []
    for name, layers, heads, dim, dtype in tqdm(LAYOUTS, desc="save/restore bandwidth", unit="layout"):
        pool = 2 * max(PAGES_PER_CALL) + 1
        rng = np.random.default_rng(0)
        pages = tuple(jnp.asarray(rng.standard_normal((pool, 16, 2 * heads, dim)), dtype) for _ in range(layers))
        for n in PAGES_PER_CALL:
            ids = np.arange(1, n + 1, dtype=np.int32)
            save_s, restore_s = [], []
            for _ in range(reps + 1):  # the first of each is the compile
                t = time.perf_counter()
                v, _ = gather_blocks(pages, jnp.asarray(ids), num_kv_heads=heads)
                host = np.asarray(v)
                save_s.append(time.perf_counter() - t)
                blocks = [KVBlock(host[i].copy(), None, None, ()) for i in range(n)]
                t = time.perf_counter()
                values = jax.device_put(np.stack([b.values for b in blocks]))
                pages = scatter_blocks(pages, values, None, jnp.asarray(ids + n))
                jax.block_until_ready(pages)
                restore_s.append(time.perf_counter() - t)
            page_bytes = host[0].nbytes
            save, restore = float(np.median(save_s[1:])), float(np.median(restore_s[1:]))
            rows.append({"layout": name, "page_bytes": page_bytes, "pages_per_call": n,
                         "save_ms_per_page": save / n * 1e3, "restore_ms_per_page": restore / n * 1e3,
                         "save_GBps": n * page_bytes / save / 1e9, "restore_GBps": n * page_bytes / restore / 1e9})
    return rows


def rag(mode: str, args) -> dict:
    """One `jaxfill bench serve` run of the RAG workload with the tier `mode`."""
    pages_per_doc = args.doc_tokens // 16 + 1
    sets = [f"engine.num_pages={4 * pages_per_doc + 2 * (pages_per_doc + 4) + 1}",
            f"engine.max_model_len={args.doc_tokens + 128}"]
    tmp = tempfile.mkdtemp(prefix="jaxfill-kvtier-")
    if mode != "off":
        sets.append(f"engine.host_kv_cache_gb={args.host_gb if mode == 'host' else args.small_host_gb}")
    if mode == "host+disk":
        sets += [f"engine.disk_kv_cache_dir={tmp}/disk", "engine.disk_kv_cache_gb=4"]
    cmd = [sys.executable, "-m", "jaxfill.serving.cli", "bench", "serve", "--config", args.config,
           "--dataset-name", "prefix_repetition", "--prefix-repetition-num-prefixes", "16",
           "--prefix-repetition-prefix-len", str(args.doc_tokens), "--prefix-repetition-suffix-len", "32",
           "--prefix-repetition-output-len", "8", "--prefix-repetition-zipf", "1.1",
           "--num-prompts", str(args.num_prompts), "--max-concurrency", "2", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", tmp, "--result-filename", "run.json", "--label", mode]
    for s in sets:
        cmd += ["--set", s]
    print(f"RAG workload, tier {mode}: {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    with open(os.path.join(tmp, "run.json")) as f:
        r = json.load(f)
    st = r["engine_stats"]
    prompt = st["prompt_tokens_measured"]
    return {"tier": mode, "median_ttft_ms": r["median_ttft_ms"], "p99_ttft_ms": r["p99_ttft_ms"],
            "completed": r["completed"], "prompt_tokens": prompt,
            "prefilled_tokens": prompt - st["cached_tokens_total"], "cached_tokens": st["cached_tokens_total"],
            "host_hit_tokens": st.get("host_kv_hits", 0) * 16, "disk_hit_tokens": st.get("disk_kv_hits", 0) * 16,
            "saves_dropped": st.get("host_kv_saves_dropped", 0), "disk_writes_dropped": st.get("disk_kv_dropped", 0),
            "duration_s": r["duration"], "overrides": sets}


def prefill_ms_per_page(args) -> float:
    """c: one document's prefill through Engine.generate, prefix caching off, per page."""
    from jaxfill import Engine, SamplingParams

    e = Engine.from_config(args.config, overrides={"engine.enable_prefix_caching": False,
                                                   "engine.max_model_len": args.doc_tokens + 128}, progress=False)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 256, args.doc_tokens)]
    times = []
    for _ in range(4):  # the first includes nothing to compile (warm-up did), but warms caches
        t = time.perf_counter()
        e.generate([prompt], SamplingParams(max_tokens=1))
        times.append(time.perf_counter() - t)
    return float(np.median(times[1:])) * 1e3 / (args.doc_tokens / 16)


def break_even(bw: list[dict], c: float, args) -> dict:
    """h = s / (c - r) for --config's page (LAYOUTS row --layout-of-config), 8 pages a call."""
    row = next(r for r in bw if r["layout"] == args.layout_of_config and r["pages_per_call"] == 8)
    s, r = row["save_ms_per_page"], row["restore_ms_per_page"]
    return {"save_ms_per_page": s, "restore_ms_per_page": r, "prefill_ms_per_page": c,
            "break_even_hit_rate": s / (c - r) if c > r else None}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, *_ in LAYOUTS:
        rows = [r for r in result["bandwidth"] if r["layout"] == name]
        xs = [r["pages_per_call"] for r in rows]
        left.plot(xs, [r["save_GBps"] for r in rows], "o-", label=f"save, {name} ({rows[0]['page_bytes'] // 1024} KB)")
        left.plot(xs, [r["restore_GBps"] for r in rows], "s--", label=f"restore, {name}")
    left.set_xscale("log")
    left.set_xlabel("pages per call")
    left.set_ylabel("GB/s (CPU, median)")
    left.set_title("save / restore bandwidth per block size")
    left.legend(fontsize=7)
    runs = result["rag"]
    xs = np.arange(len(runs))
    right.bar(xs - 0.2, [r["median_ttft_ms"] for r in runs], 0.4, label="TTFT p50")
    right.bar(xs + 0.2, [r["p99_ttft_ms"] for r in runs], 0.4, label="TTFT p99")
    for x, r in zip(xs, runs):
        right.annotate(f"{r['prefilled_tokens'] / 1000:.0f}k prefilled", (x, r["p99_ttft_ms"]), ha="center",
                       va="bottom", fontsize=8)
    right.set_xticks(xs, [r["tier"] for r in runs])
    right.set_ylabel("ms")
    right.set_title(f"RAG: 16 docs x {result['doc_tokens']} tokens, pool holds 4, Zipf 1.1")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--layout-of-config", default="tiny", help="which LAYOUTS row is --config's page")
    p.add_argument("--doc-tokens", type=int, default=2048)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--host-gb", type=float, default=1.0, help="host tier of the 'host' run (holds every document)")
    p.add_argument("--small-host-gb", type=float, default=0.025,
                   help="host tier of the 'host+disk' run: about 6 of tiny's 2k-token documents, the rest on disk")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--quick", action="store_true", help="a smoke run: short documents, few prompts")
    p.add_argument("--out", default=os.path.join(RESULTS, "kv_tier.json"))
    args = p.parse_args()
    if args.quick:
        args.doc_tokens, args.num_prompts, args.reps = 256, 12, 2
    bw = bandwidth(args.reps)
    c = prefill_ms_per_page(args)
    runs = [rag(mode, args) for mode in ("off", "host", "host+disk")]
    result = {"date": time.strftime("%Y-%m-%d"), "config": args.config, "doc_tokens": args.doc_tokens,
              "num_prompts": args.num_prompts, "bandwidth": bw, "rag": runs, "break_even": break_even(bw, c, args)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.splitext(args.out)[0] + ".png")
    print(json.dumps({"rag": runs, "break_even": result["break_even"]}, indent=1))


if __name__ == "__main__":
    main()
