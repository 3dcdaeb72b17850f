"""The planner's figures for the family presets on one H100 and one TPU v5e chip, next to
each model's published context length.

    python benchmarks/plan_families.py   -> benchmarks/results/plan_families.{json,md}

Arithmetic only (engine/planner/plan.py, from the model's abstract params): TTFT floor =
max(FLOPs / peak, bytes / bandwidth) of one prefill, KV bytes per token, and whether the
weights fit one device at all (else the smallest `mesh.tensor` that leaves room for one
request of that length). No device was used.
"""

from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = ("qwen3_8b", "qwen3_32b", "gemma2_9b", "gemma3_27b", "phi3_mini", "olmo2_7b", "llama3_8b")
HARDWARE = ("h100_sxm", "tpu_v5e")
LENGTHS = (2048, 8192)


def rows() -> list[dict]:
    from jaxfill.engine.config import load_config
    from jaxfill.engine.planner.hardware import load_hardware
    from jaxfill.engine.planner.plan import model_matmul_shape, plan_prefill

    out = []
    for name in PRESETS:
        for hw_name in HARDWARE:
            base = load_config(name)
            context = base.model.max_position_embeddings
            hw = load_hardware(hw_name, base.model.dtype, model_matmul_shape(base.model))
            for n in sorted({min(n, context - 1) for n in LENGTHS + (context - 1,)}):
                row = None
                for tensor in (1, 2, 4, 8, 16):
                    if base.model.num_heads % tensor or base.model.intermediate_size % tensor:
                        continue
                    config = load_config(name, {"mesh.tensor": tensor, "engine.max_model_len": context})
                    row = plan_prefill(config, hw, n)
                    if row["max_concurrent_requests"] >= 1:
                        break
                out.append({"preset": name, "hardware": hw_name, "context": context, "prompt_len": n,
                            "tensor": tensor, "fits": row["max_concurrent_requests"] >= 1,
                            "ttft_floor_s": row["ttft_floor_s"], "bound": row["bound"],
                            "kv_bytes_per_token": row["kv_bytes_per_token"],
                            "weight_bytes_per_device": row["weight_bytes_per_device"],
                            "max_concurrent_requests": row["max_concurrent_requests"]})
                print(f"{name} {hw_name} {n}: tensor={tensor} ttft={row['ttft_floor_s']:.3f}s", file=sys.stderr)
    return out


def markdown(table: list[dict]) -> str:
    lines = ["| preset | hardware | context | prompt | mesh.tensor | TTFT floor | bound | KV/token | "
             "weights/device | requests that fit |", "|---|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in table:
        lines.append(f"| {r['preset']} | {r['hardware']} | {r['context']} | {r['prompt_len']} | {r['tensor']}"
                     f"{'' if r['fits'] else ' (no fit)'} | {r['ttft_floor_s'] * 1e3:,.0f} ms | {r['bound']} | "
                     f"{r['kv_bytes_per_token'] / 1024:.0f} KiB | {r['weight_bytes_per_device'] / 2**30:.1f} GiB | "
                     f"{r['max_concurrent_requests']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    table = rows()
    out = os.path.join(ROOT, "benchmarks", "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "plan_families.json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "rows": table}, f, indent=1)
    md = markdown(table)
    with open(os.path.join(out, "plan_families.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
