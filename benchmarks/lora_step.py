"""Multi-LoRA step time: decode steps of 8 and 32 sequences whose rows use 0, 1, 4 or 8
adapters, on an engine with lora.max_loras = 8 (rank 16, every q/k/v/o/gate/up/down
projection targeted), against the same model with LoRA unconfigured. Both engines live in
one process and take turns (the order flips every round); the numbers are medians. Also
the time to load an adapter (read + check, Engine.load_lora) and to write it into a slot
on first use. Before timing: greedy tokens of base rows on the LoRA engine equal the
unconfigured engine's (slot 0 adds an exact zero).

Adapters are written here in PEFT's file layout (adapter_config.json +
adapter_model.safetensors, random A and B), so no torch is needed.

    python benchmarks/lora_step.py [--rounds 3] [--decode-steps 12] [--layers 4] [--out benchmarks/results/lora_step.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time

import jax
import numpy as np

from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_peft_adapter(path: str, model, rank: int, seed: int) -> str:
    """A PEFT-layout LoRA adapter of every layer's attention and MLP projections."""
    from safetensors.numpy import save_file

    m, rng = model, np.random.default_rng(seed)
    e, q, kv, i = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.intermediate_size
    dims = {"q_proj": (e, q), "k_proj": (e, kv), "v_proj": (e, kv), "o_proj": (q, e), "gate_proj": (e, i),
            "up_proj": (e, i), "down_proj": (i, e)}
    tensors = {}
    for n in range(m.num_layers):
        for name in TARGETS:
            d_in, d_out = dims[name]
            kind = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{n}.{kind}.{name}"
            tensors[key + ".lora_A.weight"] = (0.02 * rng.standard_normal((rank, d_in))).astype(np.float32)
            tensors[key + ".lora_B.weight"] = (0.02 * rng.standard_normal((d_out, rank))).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
                   "bias": "none"}, f)
    return path


def decode_step_seconds(engine: Engine, ids: list[list[int]], loras: list, steps: int) -> list[float]:
    """Per engine.step() while all sequences decode (their prefill finished first)."""
    for p, lora in zip(ids, loras):
        engine.add_request(p, SamplingParams(max_tokens=steps + 64, ignore_eos=True, lora=lora))
    produced: set[str] = set()
    while len(produced) < len(ids):
        produced |= {o.request_id for o in engine.step() if o.new_token_ids}
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    engine.abort_all()
    while engine.has_unfinished():
        engine.step()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="bench")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decode-steps", type=int, default=12)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--batches", default="8,32")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--layers", type=int, default=4, help="the preset's layers cut to this many (compile time)")
    p.add_argument("--out", default="benchmarks/results/lora_step.json")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    common = {"model.num_layers": args.layers, "engine.max_num_seqs": max(batches), "engine.max_num_batched_tokens": 256,
              "engine.token_buckets": [8, 32, 256], "engine.num_pages": 512, "engine.max_model_len": 512}
    engines = {}
    for name, extra in (("base", {}), ("lora", {"lora.max_loras": 8, "lora.max_lora_rank": args.rank})):
        t0 = time.perf_counter()
        engines[name] = Engine.from_config(args.preset, overrides={**common, **extra}, progress=False)
        print(f"{name}: built and warmed up in {time.perf_counter() - t0:.1f} s", flush=True)
    lora = engines["lora"]
    tmp = tempfile.mkdtemp(prefix="lora_bench_")
    load_s, first_use_s = [], []
    for k in range(8):
        path = write_peft_adapter(os.path.join(tmp, f"a{k}"), lora.config.model, args.rank, seed=k)
        t0 = time.perf_counter()
        lora.load_lora(f"a{k}", path)
        load_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        lora.generate([[1, 2, 3]], SamplingParams(max_tokens=1, lora=f"a{k}"))  # writes its slot
        first_use_s.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    lora.generate([[1, 2, 3]], SamplingParams(max_tokens=1, lora="a0"))  # on the device already
    resident_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    check = [rng.integers(0, 256, 40).tolist() for _ in range(4)]
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    same = [c.token_ids for c in engines["base"].generate(check, greedy)] == \
        [c.token_ids for c in lora.generate(check, greedy)]
    print(f"base rows on the LoRA engine == LoRA unconfigured: {same}", flush=True)
    cases = [("base", 0)] + [("lora", a) for a in (0, 1, 4, 8)]
    times = {(b, n, a): [] for b in batches for n, a in cases}
    for r in range(args.rounds):
        order = cases if r % 2 == 0 else cases[::-1]
        for b in batches:
            ids = [rng.integers(0, 256, args.prompt).tolist() for _ in range(b)]
            for name, adapters in order:
                loras = [f"a{j % adapters}" if adapters else None for j in range(b)]
                times[(b, name, adapters)] += decode_step_seconds(engines[name], ids, loras, args.decode_steps)
        print(f"round {r + 1}/{args.rounds}: load {os.getloadavg()[0]:.1f}", flush=True)

    rows = []
    for b in batches:
        base = statistics.median(times[(b, "base", 0)])
        for name, a in cases:
            med = statistics.median(times[(b, name, a)])
            rows.append({"batch": b, "engine": name, "adapters": a, "median_ms": 1e3 * med, "vs_base": med / base,
                         "n": len(times[(b, name, a)])})
            print(f"batch {b:3d} {name:5s} {a} adapters: {1e3 * med:7.2f} ms  ({med / base:.2f}x base)", flush=True)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "jax": jax.__version__, "backend": jax.default_backend(), "cores": os.cpu_count(),
              "loadavg": os.getloadavg(), "preset": args.preset, "args": vars(args),
              "base_rows_equal": same, "decode_step": rows,
              "load_lora_ms": {"median": 1e3 * statistics.median(load_s), "all": [1e3 * x for x in load_s]},
              "first_use_generate_ms": {"median": 1e3 * statistics.median(first_use_s),
                                        "all": [1e3 * x for x in first_use_s]},
              "resident_generate_ms": 1e3 * resident_s,
              "adapter_bytes": os.path.getsize(os.path.join(tmp, "a0", "adapter_model.safetensors")),
              "lora_stats": {k: v for k, v in lora.stats().items() if k.startswith("lora")},
              "compiled_programs": {n: e.stats()["compiled_programs"] for n, e in engines.items()}}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("load_lora_ms", "first_use_generate_ms", "resident_generate_ms")}))


if __name__ == "__main__":
    main()
