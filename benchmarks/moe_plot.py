"""The plot of RESULTS.md "Mixture of experts (issue 25)": one MoE MLP per grouped-matmul
implementation (results/moe_cpu.json), and Mixtral-shaped prefill through Engine.generate
vs transformers (results/generate_cpu_mixtral.json).

    python benchmarks/moe_plot.py   -> benchmarks/results/moe_cpu.png
"""

from __future__ import annotations

import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
COLORS = {"tiled": "tab:blue", "ragged_dot": "tab:orange", "dense loop": "tab:gray"}


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(os.path.join(RESULTS, "moe_cpu.json")) as f:
        impls = json.load(f)["impls"]
    with open(os.path.join(RESULTS, "generate_cpu_mixtral.json")) as f:
        rows = json.load(f)["rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    tokens = sorted({r["tokens"] for r in impls})
    width = 0.27
    for j, name in enumerate(COLORS):
        ys = [next(r["median_s"] for r in impls if r["tokens"] == t and r["impl"] == name) * 1e3 for t in tokens]
        left.bar([i + (j - 1) * width for i in range(len(tokens))], ys, width, color=COLORS[name], label=name)
    left.set_xticks(range(len(tokens)), [f"{t} tokens" for t in tokens])
    left.set_ylabel("one MoE MLP, ms (CPU, f32, 8 experts top 2)")
    left.set_title("grouped matmul implementations (same run)")
    left.legend()
    xs = range(len(rows))
    right.bar([x - 0.2 for x in xs], [r["hf_ttft_s"] * 1e3 for r in rows], 0.4, color="tab:gray", label="transformers")
    right.bar([x + 0.2 for x in xs], [r["generate_ttft_s"] * 1e3 for r in rows], 0.4, color="tab:blue",
              label="jaxfill Engine.generate")
    for x, r in zip(xs, rows):
        right.text(x + 0.2, r["generate_ttft_s"] * 1e3, f"{r['generate_over_hf_speed']:.2f}x", ha="center",
                   va="bottom")
    right.set_xticks(list(xs), [f"{r['prompt_len']} tokens" for r in rows])
    right.set_ylabel("TTFT, ms (CPU, f32, Mixtral-shaped bench model)")
    right.set_title("MoE prefill vs transformers (same run)")
    right.legend()
    fig.tight_layout()
    out = os.path.join(RESULTS, "moe_cpu.png")
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
