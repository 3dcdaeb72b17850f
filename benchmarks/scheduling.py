"""Scheduling benchmark, in process: (a) whole-prompt prefill first, no chunking, vs
(b) chunked stall-free scheduling, on a Poisson (gamma, burstiness 1) workload of 90%
short prompts, 10% (--long-fraction) long prompts and 1-token probe requests.

    python benchmarks/scheduling.py [--config tiny] [--requests 80] [--rate 3] [--long-fraction 0.3] [--out ...]

Reports vLLM `bench serve` keys (mean_ttft_ms, p99_itl_ms, ...) per mode, plus probe
TTFT vs step time, prefix-cached TTFT vs uncached, and chunked-prefill TTFT overhead
on one long prompt. The tiny preset's max_position_embeddings is 4096, so "long"
prompts are 2k-3.5k tokens here (scaled down from 4k-8k) and the overhead probe uses 3.5k.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxfill.engine.config import load_config  # noqa: E402
from jaxfill.engine.engine import Engine  # noqa: E402
from jaxfill.engine.loading import build_model  # noqa: E402
from jaxfill.engine.request import SamplingParams  # noqa: E402

MODES = {
    "a_prefill_first": {"engine.chunked_prefill": False, "engine.max_num_batched_tokens": 4096,
                        "engine.token_buckets": [16, 256, 1024, 2048, 3072, 4096]},
    "b_chunked": {"engine.chunked_prefill": True, "engine.max_num_batched_tokens": 512,
                  "engine.max_num_partial_prefills": 1,
                  "engine.token_buckets": [16, 128, 512]},
}
COMMON = {"engine.max_model_len": 4096, "engine.num_pages": 1536, "engine.max_num_seqs": 16,
          "engine.page_size": 16}


def workload(n: int, rate: float, seed: int, vocab: int, long_fraction: float = 0.1):
    rng = np.random.default_rng(seed)
    t, reqs = 0.0, []
    for i in range(n):
        t += rng.gamma(1.0, 1.0 / rate)  # burstiness 1 = Poisson
        if rng.random() < long_fraction:
            plen, out = int(rng.integers(2048, 3500)), 16
        else:
            plen, out = int(rng.integers(16, 257)), int(rng.integers(16, 65))
        reqs.append(dict(kind="long" if plen > 256 else "short", arrival=t,
                         prompt=rng.integers(0, 256, plen).tolist(), max_tokens=out))
    # 1-token probes every 0.5 s
    for j in range(int(t / 0.5)):
        reqs.append(dict(kind="probe", arrival=0.25 + 0.5 * j, prompt=rng.integers(0, 256, 8).tolist(),
                         max_tokens=1))
    return sorted(reqs, key=lambda r: r["arrival"])


def pct(xs, q):
    return float(np.percentile(xs, q)) if xs else float("nan")


def summarize(prefix, xs):
    return {f"mean_{prefix}_ms": 1e3 * float(np.mean(xs)) if xs else float("nan"),
            f"median_{prefix}_ms": 1e3 * pct(xs, 50), f"p99_{prefix}_ms": 1e3 * pct(xs, 99)}


def run_workload(engine: Engine, reqs):
    start = time.perf_counter()
    pending = list(reqs)
    times: dict[str, list[float]] = {}
    info: dict[str, dict] = {}
    steps = []  # (t0, t1, num long prefill tokens in flight?)
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0]["arrival"] <= now:
            r = pending.pop(0)
            rid = engine.add_request(r["prompt"], SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True))
            info[rid] = dict(r, arrival_abs=start + r["arrival"])
            times[rid] = []
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0]["arrival"] - (time.perf_counter() - start)))
            continue
        long_busy = any(info[r.request_id]["kind"] == "long" and r.remaining > 1
                        for r in engine.scheduler.running)
        t0 = time.perf_counter()
        outs = engine.step()
        t1 = time.perf_counter()
        steps.append((t0, t1, long_busy))
        for o in outs:
            times[o.request_id].extend([t1] * len(o.new_token_ids))
    dur = time.perf_counter() - start
    ttft, tpot, itl, e2e, probe_ttft = [], [], [], [], []
    out_tokens = in_tokens = 0
    for rid, ts in times.items():
        r = info[rid]
        a = r["arrival_abs"]
        if r["kind"] == "probe":
            probe_ttft.append(ts[0] - a)
            continue
        ttft.append(ts[0] - a)
        e2e.append(ts[-1] - a)
        if len(ts) > 1:
            tpot.append((ts[-1] - ts[0]) / (len(ts) - 1))
            itl.extend(np.diff(ts).tolist())
        out_tokens += len(ts)
        in_tokens += len(r["prompt"])
    n = sum(1 for r in info.values() if r["kind"] != "probe")
    step_s = [b - a for a, b, _ in steps]
    long_steps = [b - a for a, b, busy in steps if busy]
    res = {"completed": n, "duration_s": dur, "request_throughput": n / dur,
           "output_throughput": out_tokens / dur, "total_token_throughput": (in_tokens + out_tokens) / dur}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        res.update(summarize(name, xs))
        if name == "e2e":
            res = {k.replace("e2e_ms", "e2el_ms"): v for k, v in res.items()}
    res.update(summarize("probe_ttft", probe_ttft))
    res["num_probes"] = len(probe_ttft)
    res["mean_step_ms"] = 1e3 * statistics.mean(step_s)
    res["mean_step_during_long_prefill_ms"] = 1e3 * statistics.mean(long_steps) if long_steps else float("nan")
    res["probe_ttft_p50_over_long_step"] = res["median_probe_ttft_ms"] / res["mean_step_during_long_prefill_ms"]
    res["num_steps"] = len(steps)
    return res


def ttft_once(engine: Engine, prompt) -> float:
    t0 = time.perf_counter()
    for out in engine.stream(prompt, SamplingParams(max_tokens=1, ignore_eos=True)):
        if out.new_token_ids:
            return time.perf_counter() - t0
    return float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny_random")
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--rate", type=float, default=1.0, help="requests/s (Poisson)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--long-fraction", type=float, default=0.1, help="share of 2k-3.5k-token prompts")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "scheduling.json"))
    args = ap.parse_args(argv)
    base_cfg = load_config(args.config, COMMON)
    model = build_model(base_cfg, progress=False)
    reqs = workload(args.requests, args.rate, args.seed, base_cfg.model.vocab_size, args.long_fraction)
    results = {"config": args.config, "requests": args.requests, "rate": args.rate,
               "long_fraction": args.long_fraction,
               "long_prompt_tokens": "2048-3500 (scaled down from 4k-8k: tiny max_position_embeddings 4096)",
               "short_prompt_tokens": "16-256", "modes": {}}
    engines = {}
    for mode, over in MODES.items():
        t0 = time.perf_counter()
        eng = Engine(load_config(args.config, {**COMMON, **over}), progress=True, model=model)
        engines[mode] = eng
        print(f"[{mode}] warm-up {time.perf_counter() - t0:.1f}s, {len(eng.shapes)} buckets", file=sys.stderr)
        r = run_workload(eng, reqs)
        r["warmup_s"] = eng.warmup_s
        results["modes"][mode] = r
        print(f"[{mode}] " + json.dumps({k: round(v, 2) for k, v in r.items() if isinstance(v, float)}),
              file=sys.stderr)
    a, b = results["modes"]["a_prefill_first"], results["modes"]["b_chunked"]
    rng = np.random.default_rng(123)
    # Chunked-prefill overhead on one long prompt (idle engine, median of 3, fresh prompts: no cache hits).
    long_len = 3500
    ta = [ttft_once(engines["a_prefill_first"], rng.integers(0, 256, long_len).tolist()) for _ in range(3)]
    tb = [ttft_once(engines["b_chunked"], rng.integers(0, 256, long_len).tolist()) for _ in range(3)]
    # Prefix-cached vs uncached TTFT on (b): 2048-token prompt, 1536 of them shared.
    eb = engines["b_chunked"]
    shared = rng.integers(0, 256, 1536).tolist()
    unc = [ttft_once(eb, rng.integers(0, 256, 2048).tolist()) for _ in range(3)]
    ttft_once(eb, shared + rng.integers(0, 256, 512).tolist())  # fills the cache
    cached = [ttft_once(eb, shared + rng.integers(0, 256, 512).tolist()) for _ in range(3)]
    results["summary"] = {
        "p99_itl_ratio_b_over_a": b["p99_itl_ms"] / a["p99_itl_ms"],
        "throughput_ratio_b_over_a": b["total_token_throughput"] / a["total_token_throughput"],
        "request_throughput_ratio_b_over_a": b["request_throughput"] / a["request_throughput"],
        "probe_ttft_p50_steps_b": b["probe_ttft_p50_over_long_step"],
        "probe_ttft_p50_steps_a": a["probe_ttft_p50_over_long_step"],
        "chunked_overhead_tokens": long_len,
        "ttft_unchunked_ms": 1e3 * statistics.median(ta),
        "ttft_chunk512_ms": 1e3 * statistics.median(tb),
        "chunked_overhead_ratio": statistics.median(tb) / statistics.median(ta),
        "ttft_uncached_2048_ms": 1e3 * statistics.median(unc),
        "ttft_cached_1536_of_2048_ms": 1e3 * statistics.median(cached),
        "cached_ttft_ratio": statistics.median(cached) / statistics.median(unc),
        "cached_ttft_ratio_predicted_by_uncached_fraction": 512 / 2048,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(results["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
