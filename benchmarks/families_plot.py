"""The plot of RESULTS.md "Model families (issue 24)": Engine.generate vs transformers TTFT
per family (results/generate_cpu_{qwen3,gemma3}.json) and the planner's TTFT floor of
the presets (results/plan_families.json).

    python benchmarks/families_plot.py   -> benchmarks/results/families.png
"""

from __future__ import annotations

import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.35
    for i, arch in enumerate(("qwen3", "gemma3")):
        with open(os.path.join(RESULTS, f"generate_cpu_{arch}.json")) as f:
            rows = json.load(f)["rows"]
        xs = [j + i * 2.5 for j in range(len(rows))]
        left.bar([x - width / 2 for x in xs], [r["hf_ttft_s"] * 1e3 for r in rows], width, color="tab:gray",
                 label="transformers" if i == 0 else None)
        left.bar([x + width / 2 for x in xs], [r["generate_ttft_s"] * 1e3 for r in rows], width, color="tab:blue",
                 label="jaxfill Engine.generate" if i == 0 else None)
        for x, r in zip(xs, rows):
            left.text(x, r["hf_ttft_s"] * 1e3, f"{r['generate_over_hf_speed']:.2f}x", ha="center", va="bottom")
            left.text(x, -40, f"{arch}\n{r['prompt_len']}", ha="center", va="top", fontsize=8)
    left.set_xticks([])
    left.set_ylabel("TTFT, ms (CPU, f32, bench shape)")
    left.set_title("prefill: Engine.generate vs transformers (same run)")
    left.legend()
    with open(os.path.join(RESULTS, "plan_families.json")) as f:
        plan = [r for r in json.load(f)["rows"] if r["prompt_len"] == 8192 or
                (r["prompt_len"] < 8192 and r["prompt_len"] == r["context"] - 1)]
    names = sorted({r["preset"] for r in plan}, key=lambda n: [r["preset"] for r in plan].index(n))
    for k, hw in enumerate(("h100_sxm", "tpu_v5e")):
        vals = {r["preset"]: r for r in plan if r["hardware"] == hw}
        right.bar([j + (k - 0.5) * width for j in range(len(names))], [vals[n]["ttft_floor_s"] * 1e3 for n in names],
                  width, label=hw)
        for j, n in enumerate(names):
            if vals[n]["tensor"] > 1:
                right.text(j + (k - 0.5) * width, vals[n]["ttft_floor_s"] * 1e3, f"t{vals[n]['tensor']}",
                           ha="center", va="bottom", fontsize=7)
    right.set_xticks(range(len(names)), [f"{n}\n{min(8192, vals[n]['context'] - 1)}" for n in names], fontsize=7)
    right.set_ylabel("planned TTFT floor, ms")
    right.set_title("planner: 8192-token prefill (or the context); tN: mesh.tensor")
    right.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "families.png"), dpi=110)
    print(os.path.join(RESULTS, "families.png"))


if __name__ == "__main__":
    main()
