"""`jaxfill bench serve`'s report: vLLM-named metrics (mean/median/p-ile TTFT, TPOT, ITL,
E2E; throughput; goodput) from the per-request results, printed and plotted."""

from __future__ import annotations

import math

import numpy as np

from jaxfill.serving.bench_load import RequestResult


def _stats(values_s: list[float], name: str, percentiles: list[float]) -> dict:
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    out = {}
    if arr.size == 0:
        arr = np.zeros(1)
    out[f"mean_{name}_ms"] = float(arr.mean())
    out[f"median_{name}_ms"] = float(np.median(arr))
    out[f"std_{name}_ms"] = float(arr.std())
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def calculate_metrics(results: list[RequestResult], duration: float, percentiles: list[float],
                      goodput: dict[str, float] | None) -> dict:
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    e2els = [r.latency for r in ok]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    m = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": total_out / duration if duration else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration else 0.0,
        "total_cached_tokens": sum(r.cached_tokens for r in ok),
    }
    if goodput:
        good = 0
        for r in ok:
            tpot = (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
            if (r.ttft * 1e3 <= goodput.get("ttft", math.inf) and tpot * 1e3 <= goodput.get("tpot", math.inf)
                    and r.latency * 1e3 <= goodput.get("e2el", math.inf)):
                good += 1
        m["request_goodput"] = good / duration if duration else 0.0
        m["goodput_slo_ms"] = goodput
    for values, name in ((ttfts, "ttft"), (tpots, "tpot"), (itls, "itl"), (e2els, "e2el")):
        m.update(_stats(values, name, percentiles))
    # Engine step returned -> chunk in the client's hands (same host, CLOCK_MONOTONIC).
    m.update(_stats([x for r in ok for x in r.delivery], "delivery", sorted(set(percentiles) | {50.0})))
    return m


def parse_goodput(items) -> dict[str, float] | None:
    if not items:
        return None
    out = {}
    for item in items:
        key, _, val = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not val:
            raise ValueError(f"--goodput takes ttft:MS tpot:MS e2el:MS, got {item!r}")
        out[key] = float(val)
    return out


def print_report(title: str, m: dict) -> None:
    w = 50
    print("{s:{c}^{n}}".format(s=f" {title} ", n=w, c="="))
    rows = [("Successful requests", m["completed"]), ("Failed requests", m["failed"]),
            ("Benchmark duration (s)", f"{m['duration']:.2f}"), ("Total input tokens", m["total_input_tokens"]),
            ("Total generated tokens", m["total_output_tokens"]),
            ("Request throughput (req/s)", f"{m['request_throughput']:.2f}")]
    if "request_goodput" in m:
        rows.append(("Request goodput (req/s)", f"{m['request_goodput']:.2f}"))
    rows += [("Output token throughput (tok/s)", f"{m['output_throughput']:.2f}"),
             ("Total token throughput (tok/s)", f"{m['total_token_throughput']:.2f}")]
    for k, v in rows:
        print(f"{k:<40}{v:>10}")
    for name, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency"),
                        ("delivery", "Step end -> client (streaming overhead)")):
        print("{s:{c}^{n}}".format(s=label, n=w, c="-"))
        for k, v in m.items():
            if k.endswith(f"_{name}_ms") and not k.startswith("std"):
                print(f"{k:<40}{v:>10.2f}")
    print("=" * w, flush=True)


def plot(path: str, runs: dict[str, tuple[list[RequestResult], dict]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    for label, (results, _m) in runs.items():
        ok = [r for r in results if r.success]
        for ax, values in ((axes[0], [r.ttft * 1e3 for r in ok]),
                           (axes[1], [x * 1e3 for r in ok for x in r.itl]),
                           (axes[3], [x * 1e3 for r in ok for x in r.delivery])):
            if values:
                v = np.sort(values)
                ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label)
        axes[2].scatter([r.start - min(x.start for x in results) for r in ok], [r.latency * 1e3 for r in ok],
                        s=6, label=label)
    axes[0].set(xlabel="TTFT (ms)", ylabel="CDF", title="time to first token")
    axes[1].set(xlabel="inter-token latency (ms)", ylabel="CDF", title="inter-token latency")
    axes[2].set(xlabel="request start (s into run)", ylabel="end-to-end latency (ms)", title="E2E latency")
    axes[3].set(xlabel="engine step end -> client (ms)", ylabel="CDF", title="per-chunk delivery (streaming overhead)")
    axes[3].set_xscale("log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
