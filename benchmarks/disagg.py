"""Three ways to serve long prompts next to short ones (issue 13), on the same CPU cores:

  a_prefill_first   one worker, engine.chunked_prefill=false: a long prompt runs whole and
                    every running decode waits for it
  b_chunked         one worker, chunked prefill mixed with decode (256-token budget)
  c_disaggregated   1 `--role prefill` + 1 `--role decode` worker behind smg --pd-disaggregation,
                    KV pages moved by jax.experimental.transfer
  d_two_chunked     2 chunked workers behind smg (cache_aware): the same-hardware control for (c)

Every route is driven through the real `smg` gateway with the openai client (streaming,
ignore_eos, greedy), so the gateway hop is common to all four. One workload: Poisson
arrivals, 75% short prompts (16-128 tokens, 40% of them opening with one of three shared
~250-token prefixes, 32-64 output tokens), 25% long ones (2k-3.5k tokens, 16 output tokens). Per route: TTFT / ITL p50 and p99, request and output-token throughput, and
goodput (requests per second meeting both SLOs: TTFT <= --slo-ttft-ms and mean ITL <=
--slo-itl-ms). For (c), KV bytes moved per request by the planner's formula
(prompt tokens x kv_bytes_per_token, engine/planner/plan.py) unless the workers report it.

    python benchmarks/disagg.py [--requests 80] [--rate 8] [--long-fraction 0.25] [--routes a,b,c,d]

Writes benchmarks/results/disagg.json and disagg.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from gateway_util import SmgProcess, kill_all, start_worker  # noqa: E402
from serving_util import scrape  # noqa: E402

COMMON = ["engine.max_model_len=4096", "engine.num_pages=2048", "engine.max_num_seqs=16"]
CHUNKED = ["engine.chunked_prefill=true", "engine.max_num_batched_tokens=256", "engine.token_buckets=[16, 64, 256]"]
WHOLE = ["engine.chunked_prefill=false", "engine.max_num_batched_tokens=4096",
         "engine.token_buckets=[16, 64, 256, 1024, 4096]"]
# smg's prefill leg must answer within --worker-wedge-secs (default 3 s): too short on 2 loaded cores.
SMG_FLAGS = ["--worker-wedge-secs", "60"]


def settings(*groups) -> list[str]:
    return [a for g in groups for s in g for a in ("--set", s)]


def workload(n: int, rate: float, long_fraction: float = 0.25, seed: int = 0) -> list[dict]:
    """Arrival time, prompt text and output length per request (byte-level tiny tokenizer:
    one ASCII character is about one token)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz     "))
    text = lambda k: "".join(rng.choice(letters, k))  # noqa: E731
    prefixes = [f"[system {i}] " + text(240) for i in range(3)]
    t, out = 0.0, []
    for i in range(n):
        t += rng.exponential(1.0 / rate)
        if rng.random() < long_fraction:
            kind, prompt, max_tokens = "long", text(int(rng.integers(2048, 3584))), 16
        else:
            kind, max_tokens = "short", int(rng.integers(32, 65))
            body = text(int(rng.integers(16, 128)))
            prompt = (prefixes[int(rng.integers(0, 3))] + body) if rng.random() < 0.4 else body
        out.append({"i": i, "kind": kind, "arrival": t, "prompt": prompt, "max_tokens": max_tokens})
    return out


def drive(gateway: SmgProcess, reqs: list[dict]) -> tuple[list[dict], float]:
    """Sends each request at its arrival time on its own thread; per request: TTFT, chunk
    arrivals, usage."""
    import openai

    client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=300)
    results: list[dict] = [None] * len(reqs)

    def one(k: int, r: dict, start: float):
        delay = start + r["arrival"] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        t0, arrivals, usage, error = time.perf_counter(), [], None, None
        try:
            for chunk in client.completions.create(model=gateway.model, prompt=r["prompt"], max_tokens=r["max_tokens"],
                                                   temperature=0, stream=True, stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True}):
                if chunk.choices and chunk.choices[0].text:
                    arrivals.append(time.perf_counter() - t0)
                usage = chunk.usage or usage
        except Exception as e:  # noqa: BLE001 - counted as a failed request
            error = repr(e)
        cached = (usage.prompt_tokens_details.cached_tokens or 0) if usage and usage.prompt_tokens_details else 0
        results[k] = {"i": r["i"], "kind": r["kind"], "arrivals": arrivals, "error": error,
                      "prompt_tokens": usage.prompt_tokens if usage else 0,
                      "completion_tokens": usage.completion_tokens if usage else 0, "cached_tokens": cached}

    start = time.perf_counter() + 0.5
    threads = [threading.Thread(target=one, args=(k, r, start)) for k, r in enumerate(reqs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def pct(xs, q) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def summarize(results: list[dict], elapsed: float, slo_ttft: float, slo_itl: float) -> dict:
    ok = [r for r in results if not r["error"] and r["arrivals"]]
    ttft = [r["arrivals"][0] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["arrivals"], r["arrivals"][1:])]

    def meets(r):
        gaps = np.diff(r["arrivals"])
        return r["arrivals"][0] <= slo_ttft and (gaps.mean() if len(gaps) else 0.0) <= slo_itl

    by_kind = {k: {"ttft_p50_ms": 1e3 * pct([r["arrivals"][0] for r in ok if r["kind"] == k], 50),
                   "ttft_p99_ms": 1e3 * pct([r["arrivals"][0] for r in ok if r["kind"] == k], 99)}
               for k in ("short", "long")}
    return {"requests": len(results), "failed": len(results) - len(ok), "elapsed_s": elapsed,
            "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
            "itl_p50_ms": 1e3 * pct(itl, 50), "itl_p99_ms": 1e3 * pct(itl, 99),
            "requests_per_s": len(ok) / elapsed,
            "output_tokens_per_s": sum(r["completion_tokens"] for r in ok) / elapsed,
            "goodput_requests_per_s": sum(meets(r) for r in ok) / elapsed,
            "slo_met_fraction": sum(meets(r) for r in ok) / len(results),
            "cached_tokens": sum(r["cached_tokens"] for r in ok), "by_kind": by_kind}


def transfer_seconds(shapes: set[tuple[int, ...]], dtype: str, repeats: int = 5) -> dict:
    """Median loopback time of one pull of a [L, T, 2*Hkv, D] array per shape, between two
    TransferAgents (engine/disagg/transfer.py, the workers' own code path) in this process,
    connection already open: offer -> pull -> every byte arrived."""
    import jax.numpy as jnp

    from jaxfill.engine.disagg.transfer import TransferAgent, wait_ready

    owner, puller = TransferAgent(), TransferAgent()
    out = {}
    for shape in sorted(shapes):
        x = jnp.ones(shape, dtype)
        times = []
        for _ in range(repeats + 1):  # the first opens the connection
            t0 = time.perf_counter()
            tid = owner.offer([x], timeout_s=30)
            assert wait_ready(puller.pull(owner.address, tid, [(shape, dtype)]), time.time() + 30)
            times.append(time.perf_counter() - t0)
        out[shape] = float(np.median(times[1:]))
    return out


def kv_transfer_per_request(results: list[dict]) -> dict:
    """Prompt K/V one disaggregated request moves: the planner's logical bytes (prompt tokens
    x kv_bytes_per_token) and the rows the prefill worker really sends (padded to a power of
    two of pages, engine/kv_rows.py), with their loopback transfer time."""
    from jaxfill.engine.config import load_config
    from jaxfill.engine.kv_rows import padded_tokens
    from jaxfill.engine.planner.counts import kv_bytes_per_token, kv_transfer_bytes

    cfg = load_config("tiny")
    m, page = cfg.model, cfg.engine.page_size
    ok = [r for r in results if not r["error"]]
    logical = [kv_transfer_bytes(m, r["prompt_tokens"]) for r in ok]
    rows = [padded_tokens(r["prompt_tokens"] - 1, page) for r in ok]  # the last prompt token runs on decode
    shape = lambda t: (m.num_layers, t, 2 * m.num_kv_heads, m.head_dim)  # noqa: E731
    secs = transfer_seconds({shape(t) for t in rows}, m.dtype)
    per_req_s = [secs[shape(t)] for t in rows]
    wire = [t * kv_bytes_per_token(m) for t in rows]
    return {"logical_bytes_source": "planner formula: prompt tokens x kv_bytes_per_token",
            "wire_bytes_source": "engine/kv_rows.padded_tokens(prompt - 1) rows x kv_bytes_per_token",
            "transfer_s_source": "measured: one loopback pull of that shape between two TransferAgents in "
                                 "one process (median of 5), not timed inside the served run",
            "logical_bytes_mean": float(np.mean(logical)), "logical_bytes_max": float(max(logical)),
            "wire_bytes_mean": float(np.mean(wire)), "wire_bytes_max": float(max(wire)),
            "transfer_ms_mean": 1e3 * float(np.mean(per_req_s)), "transfer_ms_max": 1e3 * float(max(per_req_s)),
            "loopback_gbps_at_max": 8e-9 * max(wire) / max(per_req_s)}


def prefix_cache_hits(workers) -> float:
    """Prompt tokens the workers served from cached pages (their /metrics)."""
    return sum(v for w in workers for (name, _), v in scrape(w.metrics_port).items()
               if name == "jaxfill_prefix_cache_hits_total")


def roles_supported() -> bool:
    from jaxfill.serving.commands import serve

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return any("--role" in a.option_strings for a in p._actions)


def route(name: str, cache_dir: str, reqs: list[dict], args) -> dict:
    procs = []
    try:
        def worker(*extra):
            procs.append(start_worker(cache_dir, *extra))
            return procs[-1]

        if name == "a_prefill_first":
            gw = SmgProcess([worker(*settings(COMMON, WHOLE)).address], "round_robin", *SMG_FLAGS)
        elif name == "b_chunked":
            gw = SmgProcess([worker(*settings(COMMON, CHUNKED)).address], "round_robin", *SMG_FLAGS)
        elif name == "c_disaggregated":
            p = worker("--role", "prefill", *settings(COMMON, CHUNKED, ["engine.max_num_batched_tokens=4096",
                                                                        "engine.token_buckets=[16, 256, 4096]"]))
            d = worker("--role", "decode", *settings(COMMON, CHUNKED))
            gw = SmgProcess([], "round_robin", *SMG_FLAGS, prefill=[p.address], decode=[d.address])
        elif name == "d_two_chunked":
            ws = [worker(*settings(COMMON, CHUNKED)) for _ in range(2)]
            gw = SmgProcess([w.address for w in ws], "cache_aware", *SMG_FLAGS)
        else:
            raise ValueError(f"unknown route {name!r}")
        procs.append(gw)
        drive(gw, workload(4, 100.0, 0.5, seed=99))  # warm the connections and first-request paths
        load_before = os.getloadavg()[0]  # other processes on the same cores skew every number
        hits_before = prefix_cache_hits(procs[:-1])
        results, elapsed = drive(gw, reqs)
        out = {"route": name, **summarize(results, elapsed, args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3),
               "prefix_cache_hit_tokens": prefix_cache_hits(procs[:-1]) - hits_before,
               "loadavg_1min": [load_before, os.getloadavg()[0]]}
        if name == "c_disaggregated":
            log = "".join(gw.lines)
            out["kv_relayed"] = "no kv_connector detected" not in log and "no kv_transfer_params" not in log
            kill_all(*reversed(procs))  # free the cores before timing the transfers
            out["kv_transfer"] = kv_transfer_per_request(results)
        print(json.dumps(out), flush=True)
        return out
    finally:
        kill_all(*reversed(procs))


def plot(runs: list[dict], path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["route"] for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    x = np.arange(len(names))
    for ax, key, title in ((axes[0], "ttft", "TTFT (ms)"), (axes[1], "itl", "ITL (ms)")):
        ax.bar(x - 0.2, [r[f"{key}_p50_ms"] for r in runs], 0.4, label="p50")
        ax.bar(x + 0.2, [r[f"{key}_p99_ms"] for r in runs], 0.4, label="p99")
        ax.set_title(title)
        ax.set_yscale("log")
        ax.legend()
    axes[2].bar(x - 0.2, [r["output_tokens_per_s"] for r in runs], 0.4, label="output tok/s")
    ax2 = axes[2].twinx()
    ax2.bar(x + 0.2, [r["goodput_requests_per_s"] for r in runs], 0.4, color="C2", label="goodput req/s")
    axes[2].set_title("throughput (left) / goodput (right)")
    for ax in axes:
        ax.set_xticks(x, [n.split("_", 1)[0] for n in names])
    fig.suptitle("; ".join(names), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=80)
    p.add_argument("--rate", type=float, default=8.0, help="mean arrivals per second (Poisson)")
    p.add_argument("--long-fraction", type=float, default=0.25, help="share of 2k-3.5k-token prompts")
    p.add_argument("--routes", default="a,b,c,d")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-itl-ms", type=float, default=25.0)
    p.add_argument("--cache-dir", default="/tmp/jaxfill_disagg_bench_cache", help="XLA compile cache")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "disagg.json"))
    args = p.parse_args()
    names = {"a": "a_prefill_first", "b": "b_chunked", "c": "c_disaggregated", "d": "d_two_chunked"}
    wanted = [names[k.strip()] for k in args.routes.split(",")]
    reqs = workload(args.requests, args.rate, args.long_fraction)
    runs, skipped = [], {}
    for name in wanted:
        if name == "c_disaggregated" and not roles_supported():
            skipped[name] = "jaxfill serve has no --role yet (issue 13 worker side)"
            continue
        runs.append(route(name, args.cache_dir, reqs, args))
    result = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "config": "tiny", "args": vars(args),
              "workload": {"requests": len(reqs), "long": sum(r["kind"] == "long" for r in reqs),
                           "prompt_chars_mean": float(np.mean([len(r["prompt"]) for r in reqs]))},
              "common": COMMON, "chunked": CHUNKED, "whole": WHOLE, "runs": runs, "skipped": skipped}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if runs:
        plot(runs, os.path.splitext(args.out)[0] + ".png")
    for r in runs:
        print(f"{r['route']:16s} TTFT p50 {r['ttft_p50_ms']:7.0f} p99 {r['ttft_p99_ms']:7.0f} ms | ITL p50 "
              f"{r['itl_p50_ms']:5.1f} p99 {r['itl_p99_ms']:6.1f} ms | {r['requests_per_s']:.2f} req/s "
              f"{r['output_tokens_per_s']:.0f} tok/s | goodput {r['goodput_requests_per_s']:.2f} req/s | "
              f"failed {r['failed']}")


if __name__ == "__main__":
    main()
