"""Multi-LoRA step time: decode steps of 8 and 32 sequences whose rows use 0, 1, 4 or 8
adapters, on an engine with lora.max_loras = 8 (rank 16, every q/k/v/o/gate/up/down
projection targeted), against the same model with LoRA unconfigured. One engine per case
lives in the process (the LoRA ones load their programs from the compile cache) and the
cases take one decode step each in turn, so load on the shared machine falls on all of
them alike; the numbers are medians. Also
the time to load an adapter (read + check, Engine.load_lora) and to write it into a slot
on first use, and a 256-token prefill per case (one row set: the adapter a0, or none for
base and lora0). Before timing: greedy tokens of base rows on the LoRA engine equal the
unconfigured engine's (slot 0 adds an exact zero).

Adapters are written here in PEFT's file layout (adapter_config.json +
adapter_model.safetensors, random A and B), so no torch is needed.

    python benchmarks/lora_step.py [--rounds 3] [--decode-steps 20] [--layers 4] [--out benchmarks/results/lora_step.json]
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


def interleaved_decode(cases: dict, ids: list[list[int]], steps: int) -> dict[str, list[float]]:
    """Per engine.step() while every case's sequences decode: one step of each case in turn
    (the order rotating), so load on the shared machine falls on all cases alike."""
    for engine, loras in cases.values():
        for p, lora in zip(ids, loras):
            engine.add_request(p, SamplingParams(max_tokens=steps + 64, ignore_eos=True, lora=lora))
    for engine, _ in cases.values():
        produced: set[str] = set()
        while len(produced) < len(ids):
            produced |= {o.request_id for o in engine.step() if o.new_token_ids}
    names, times = list(cases), {name: [] for name in cases}
    for s in range(steps):
        for name in names[s % len(names):] + names[:s % len(names)]:
            t0 = time.perf_counter()
            cases[name][0].step()
            times[name].append(time.perf_counter() - t0)
    for engine, _ in cases.values():
        engine.abort_all()
        while engine.has_unfinished():
            engine.step()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="bench")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decode-steps", type=int, default=20)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--prefills", type=int, default=4, help="256-token prefills per case and round")
    p.add_argument("--batches", default="8,32")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--layers", type=int, default=4, help="the preset's layers cut to this many (compile time)")
    p.add_argument("--out", default="benchmarks/results/lora_step.json")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    common = {"model.num_layers": args.layers, "engine.max_num_seqs": max(batches), "engine.max_num_batched_tokens": 256,
              "engine.token_buckets": [8, 32, 256], "engine.num_pages": 512, "engine.max_model_len": 512}
    engines = {}
    lora_on = {"lora.max_loras": 8, "lora.max_lora_rank": args.rank}
    counts = (0, 1, 4, 8)
    for name, extra in [("base", {})] + [(f"lora{a}", lora_on) for a in counts]:
        t0 = time.perf_counter()  # the LoRA engines after the first load their programs from the compile cache
        engines[name] = Engine.from_config(args.preset, overrides={**common, **extra}, progress=False)
        print(f"{name}: built and warmed up in {time.perf_counter() - t0:.1f} s", flush=True)
    lora = engines["lora8"]
    tmp = tempfile.mkdtemp(prefix="lora_bench_")
    paths = [write_peft_adapter(os.path.join(tmp, f"a{k}"), lora.config.model, args.rank, seed=k) for k in range(8)]
    load_s, first_use_s = [], []
    for k, path in enumerate(paths):
        t0 = time.perf_counter()
        lora.load_lora(f"a{k}", path)
        load_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        lora.generate([[1, 2, 3]], SamplingParams(max_tokens=1, lora=f"a{k}"))  # writes its slot
        first_use_s.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    lora.generate([[1, 2, 3]], SamplingParams(max_tokens=1, lora="a0"))  # on the device already
    resident_s = time.perf_counter() - t0
    for a in counts[:-1]:
        for k in range(a):
            engines[f"lora{a}"].load_lora(f"a{k}", paths[k])
    rng = np.random.default_rng(0)
    check = [rng.integers(0, 256, 40).tolist() for _ in range(4)]
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    same = [c.token_ids for c in engines["base"].generate(check, greedy)] == \
        [c.token_ids for c in lora.generate(check, greedy)]
    print(f"base rows on the LoRA engine == LoRA unconfigured: {same}", flush=True)
    cases = [("base", 0)] + [(f"lora{a}", a) for a in counts]
    times = {(b, name): [] for b in batches for name, _ in cases}
    prefill = {name: [] for name, _ in cases}
    for r in range(args.rounds):
        for b in batches:
            ids = [rng.integers(0, 256, args.prompt).tolist() for _ in range(b)]
            run = {name: (engines[name], [f"a{j % a}" if a else None for j in range(b)]) for name, a in cases}
            for name, xs in interleaved_decode(run, ids, args.decode_steps).items():
                times[(b, name)] += xs
        for k in range(args.prefills):  # one 256-token prompt per case in turn (fresh: no prefix hit)
            ids = rng.integers(0, 256, 256).tolist()
            for name, a in (cases if k % 2 == 0 else cases[::-1]):
                t0 = time.perf_counter()
                engines[name].generate([ids], SamplingParams(max_tokens=1, lora="a0" if a else None))
                prefill[name].append(time.perf_counter() - t0)
        print(f"round {r + 1}/{args.rounds}: load {os.getloadavg()[0]:.1f}", flush=True)

    rows = []
    for b in batches:
        base = statistics.median(times[(b, "base")])
        for name, a in cases:
            med = statistics.median(times[(b, name)])
            rows.append({"batch": b, "engine": "base" if name == "base" else "lora", "adapters": a,
                         "median_ms": 1e3 * med, "vs_base": med / base, "n": len(times[(b, name)])})
            print(f"batch {b:3d} {name:5s}: {1e3 * med:7.2f} ms  ({med / base:.2f}x base)", flush=True)
    base_prefill = statistics.median(prefill["base"])
    prefill_rows = [{"engine": name, "adapter_rows": bool(a), "median_ms": 1e3 * statistics.median(xs),
                     "vs_base": statistics.median(xs) / base_prefill, "n": len(xs)} for (name, a), xs in
                    zip(cases, prefill.values())]
    for row in prefill_rows:
        print(f"prefill 256 {row['engine']:5s}: {row['median_ms']:7.1f} ms ({row['vs_base']:.2f}x base)", flush=True)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "jax": jax.__version__, "backend": jax.default_backend(), "cores": os.cpu_count(),
              "loadavg": os.getloadavg(), "preset": args.preset, "args": vars(args),
              "base_rows_equal": same, "decode_step": rows, "prefill_256": prefill_rows,
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
