"""The planner's answer for a 1M-token prompt under context parallelism (mesh.sequence),
issue 28: KV bytes per device, whether it fits, the TTFT floor, the ring form it takes
and the decay coefficient TTFT(2S)/TTFT(S). Arithmetic (engine/planner/plan.py), not a
measurement: nothing runs on a device.

    python benchmarks/context_plan.py            # markdown table on stdout

Writes benchmarks/results/context_plan.json. The presets' rope stops at 8192 positions
(Llama 3), so every row sets model.max_position_embeddings and engine.max_model_len past
the prompt: the arithmetic of the shape, not a claim that the model reads 1M tokens well.
The Llama-3-405B row is its published shape as overrides of llama3_70b, on Meta's mesh
(arXiv 2411.01783: TP8 x CP16 on 128 H100s).
"""

from __future__ import annotations

import json
import os

from jaxfill.engine.config import load_config
from jaxfill.engine.planner.hardware import load_hardware
from jaxfill.engine.planner.plan import plan_prefill

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MILLION = 1 << 20
LLAMA3_405B = {"model.hidden_size": 16384, "model.intermediate_size": 53248, "model.num_layers": 126,
               "model.num_heads": 128, "model.num_kv_heads": 8, "model.head_dim": 128}
# (label, config, overrides, hardware, tensor, sequence, prompt)
ROWS = [
    ("llama3_8b", "llama3_8b", {}, "h200", 1, 8, MILLION),
    ("llama3_8b", "llama3_8b", {}, "h200", 1, 16, MILLION),
    ("llama3_70b", "llama3_70b", {}, "h200", 8, 8, MILLION),
    ("llama3_70b", "llama3_70b", {}, "h200", 8, 16, MILLION),
    ("llama3_8b", "llama3_8b", {}, "tpu_v5e", 8, 16, MILLION),
    ("llama3_8b", "llama3_8b", {}, "tpu_v5e", 8, 32, MILLION),
    ("llama3_70b", "llama3_70b", {}, "tpu_v5e", 16, 16, MILLION),
    ("llama3_405b shape", "llama3_70b", LLAMA3_405B, "h100_sxm", 8, 16, MILLION),
    ("llama3_405b shape", "llama3_70b", LLAMA3_405B, "h100_sxm", 8, 16, 131072),
    ("llama3_405b shape, int8 weights", "llama3_70b", {**LLAMA3_405B, "model.weight_dtype": "int8"},
     "h100_sxm", 8, 16, MILLION),
    ("llama3_405b shape, int8 weights", "llama3_70b", {**LLAMA3_405B, "model.weight_dtype": "int8"},
     "h100_sxm", 8, 16, 131072),
]


def row(label, name, overrides, hardware, tensor, sequence, prompt) -> dict:
    length = 2 * MILLION
    cfg = load_config(name, {**overrides, "mesh.tensor": tensor, "mesh.sequence": sequence,
                             "model.max_position_embeddings": length, "engine.max_model_len": length})
    r = plan_prefill(cfg, load_hardware(hardware), prompt)
    keep = ("prompt_len", "kv_bytes_per_device", "weight_bytes_per_device", "activation_bytes_estimate",
            "hbm_bytes_per_device", "fits", "ttft_floor_s", "ring_mode", "pass_q_ttft_floor_s",
            "pass_kv_ttft_floor_s", "pass_q_collective_bytes_per_device", "pass_kv_collective_bytes_per_device",
            "compute_s", "collective_s", "decay_coefficient")
    return {"model": label, "hardware": hardware, "tensor": tensor, "sequence": sequence,
            "devices": tensor * sequence, **{k: r.get(k) for k in keep}}


def markdown(rows: list[dict]) -> str:
    gib = lambda x: f"{x / (1 << 30):.1f} GiB"  # noqa: E731
    lines = ["| model | hardware | tensor x sequence (devices) | prompt | KV/device | weights/device | fits | "
             "TTFT floor | ring mode | pass-Q floor | pass-KV floor | decay TTFT(2S)/TTFT(S) |",
             "|---|---|---|---:|---:|---:|---|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['hardware']} | {r['tensor']} x {r['sequence']} ({r['devices']}) | "
                     f"{r['prompt_len']:,} | {gib(r['kv_bytes_per_device'])} | {gib(r['weight_bytes_per_device'])} | "
                     f"{'yes' if r['fits'] else 'no'} | {r['ttft_floor_s']:.1f} s | {r['ring_mode']} | "
                     f"{r['pass_q_ttft_floor_s']:.1f} s | {r['pass_kv_ttft_floor_s']:.1f} s | "
                     f"{r['decay_coefficient']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    rows = [row(*spec) for spec in ROWS]
    out = os.path.join(ROOT, "benchmarks", "results", "context_plan.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)
    print(markdown(rows))


if __name__ == "__main__":
    main()
