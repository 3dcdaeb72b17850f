"""Markdown tables and the bubble plot of benchmarks/results/pipeline.json (benchmarks/pipeline.py)."""

from __future__ import annotations

import sys


def tables(result: dict) -> str:
    """Markdown tables of a result file (for benchmarks/RESULTS.md)."""
    out = []
    if "bubble" in result:
        out += ["| p | fake devices | m | predicted (p-1)/(m+p-1) | bubble, CPU time | bubble, wall "
                "(core-normalised) | wall s | 1-device model wall s | loadavg |", "|---:" * 9 + "|"]
        single = result.get("single_device", {}).get("wall_s", float("nan"))
        for r in result["bubble"]:
            out.append(f"| {r['stages']} | {r['devices']} | {r['microbatches']} | {r['predicted_bubble']:.2f} "
                       f"| {r['bubble_cpu']:.2f} | {r['bubble_core_normalised']:.2f} | {r['wall_s']:.2f} "
                       f"| {single:.2f} | {r['loadavg_1min']:.1f} |")
    for prof in result.get("profile", []):
        out += ["", f"p={prof['stages']}, m={prof['microbatches']} (traced wall {prof['wall_s_traced']:.2f} s, "
                f"loadavg {prof['loadavg_1min']:.1f}):", "",
                "| stage | window ms | busy ms | useful ms | fill/drain ms | all-gather+copy before loop ms "
                "| rendezvous wait ms | bubble (1 - useful/window) | predicted |", "|---:" * 9 + "|"]
        for r in prof["per_stage"]:
            out.append(f"| {r['stage']} | {r['window_us'] / 1e3:.0f} | {r['busy_us'] / 1e3:.0f} "
                       f"| {r['useful_us'] / 1e3:.0f} "
                       f"| {r['fill_drain_us'] / 1e3:.0f} | {r['pre_loop_gather_copy_us'] / 1e3:.0f} "
                       f"| {r['rendezvous_wait_us'] / 1e3:.0f} | {r['bubble_profile']:.2f} "
                       f"| {r['predicted_bubble']:.2f} |")
    if "per_device_bytes" in result:
        b = result["per_device_bytes"]
        out += ["", "| stages | bench weights MB (arrays) | bench KV MB (arrays) | bench weights MB (shard shapes) "
                "| llama3_8b weights GB | llama3_8b KV GB |", "|---:|---:|---:|---:|---:|---:|"]
        for a, s, big in zip(b["bench_arrays"], b["bench_abstract"], b["llama3_8b_abstract"]):
            out.append(f"| {a['stages']} | {a['weight_bytes_device0'] / 1e6:.1f} | {a['kv_bytes_device0'] / 1e6:.2f} "
                       f"| {s['weight_bytes_device0'] / 1e6:.1f} | {big['weight_bytes_device0'] / 1e9:.2f} "
                       f"| {big['kv_bytes_device0'] / 1e9:.3f} |")
    if "boundary_vs_tensor" in result:
        h = result["boundary_vs_tensor"]
        out += ["", "| layout (2 devices) | collective | count in HLO | in tick loop | result | bytes/token executed |",
                "|---|---|---:|---|---|---:|"]
        for name in ("stage2", "tensor2", "stage2_logits_split_over_stage"):
            seen = {}
            for op in h[name]["ops"]:
                key = (op["op"], op["in_loop"], op["result"])
                seen[key] = seen.get(key, 0) + 1
            for (op, loop, shape), n in seen.items():
                trips = h["microbatches"] + 1 if loop else 1  # m + p - 1 ticks, p = 2
                per = n * next(o["bytes"] for o in h[name]["ops"] if o["result"] == shape and o["op"] == op)
                out.append(f"| {name} | {op} | {n} | {'x' + str(trips) if loop else ''} | {shape} "
                           f"| {per * trips / h['tokens']:.0f} |")
        out += ["", "| model | dtype | pipeline boundary B/token | tensor=2 ring all-reduce B/token (per device) "
                "| ratio |", "|---|---|---:|---:|---:|"]
        for name, a in h["analytic"].items():
            pb, tp = a["pipeline_boundary_bytes_per_token"], a["tensor2_allreduce_bytes_per_token"]
            out.append(f"| {name} | {a['dtype']} | {pb} | {tp:.0f} | {tp / pb:.0f} |")
    return "\n".join(out)


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot (pip install matplotlib)", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for (p, d), color in zip(sorted({(r["stages"], r["devices"]) for r in rows}), "bgrm"):
        mine = sorted((r for r in rows if (r["stages"], r["devices"]) == (p, d)), key=lambda r: r["microbatches"])
        ms = [r["microbatches"] for r in mine]
        ax.plot(ms, [r["bubble_core_normalised"] for r in mine], "o-", color=color, label=f"p={p}, {d} dev: wall")
        ax.plot(ms, [r["bubble_cpu"] for r in mine], "s:", color=color, label=f"p={p}, {d} dev: CPU time")
        ax.plot(ms, [r["predicted_bubble"] for r in mine], "--", color=color, alpha=0.4)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("microbatches m")
    ax.set_ylabel("bubble fraction (dashed: (p-1)/(m+p-1))")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
