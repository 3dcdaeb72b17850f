"""Step time, layers unrolled vs `engine.scan_layers`, on the bench preset: steady decode
of 16 sequences and one 512-token prefill. Both engines live in one process and take
turns (the order flips every round), so load on the shared machine hits both alike; the
numbers are medians. Before timing, greedy tokens of the two engines are compared.

    python benchmarks/scan_step_time.py [--rounds 6] [--decode-steps 30] [--num-pages N] [--out benchmarks/results/scan_step_time.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import jax
import numpy as np

from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams

VARIANTS = {"unrolled": False, "scan": True}


def build(preset: str, scan: bool, prefill_tokens: int, num_pages: int) -> Engine:
    overrides = {"engine.scan_layers": scan, "engine.max_num_batched_tokens": prefill_tokens,
                 "engine.token_buckets": [16, prefill_tokens]}
    if num_pages:
        overrides["engine.num_pages"] = num_pages
    return Engine.from_config(preset, overrides=overrides, progress=False)


def prompts(rng: np.random.Generator, n: int, length: int) -> list[list[int]]:
    """Random byte tokens: fresh ones each round, so the prefix cache never hits."""
    return [rng.integers(0, 256, length).tolist() for _ in range(n)]


def decode_step_seconds(engine: Engine, ids: list[list[int]], steps: int) -> list[float]:
    """Per engine.step() while all sequences decode (prefill finished first)."""
    params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    for p in ids:
        engine.add_request(p, params)
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


def prefill_seconds(engine: Engine, ids: list[int]) -> float:
    """One prompt through generate with max_tokens=1: one step of len(ids) tokens."""
    t0 = time.perf_counter()
    engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="bench")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--decode-steps", type=int, default=30)
    p.add_argument("--decode-prompt", type=int, default=128)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--prefills-per-round", type=int, default=3)
    p.add_argument("--num-pages", type=int, default=0, help="KV pool size; 0: the preset's")
    p.add_argument("--out", default="benchmarks/results/scan_step_time.json")
    args = p.parse_args()
    engines = {}
    for name, scan in VARIANTS.items():
        t0 = time.perf_counter()
        engines[name] = build(args.preset, scan, args.prefill_tokens, args.num_pages)
        print(f"{name}: built and warmed up in {time.perf_counter() - t0:.1f} s", flush=True)

    rng = np.random.default_rng(0)
    check = prompts(rng, 4, 40)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tokens = {n: [c.token_ids for c in e.generate(check, greedy)] for n, e in engines.items()}
    same = tokens["scan"] == tokens["unrolled"]
    print(f"greedy tokens scan == unrolled: {same}", flush=True)

    decode = {n: [] for n in engines}
    prefill = {n: [] for n in engines}
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        dec_ids = prompts(rng, 16, args.decode_prompt)
        pre_ids = prompts(rng, args.prefills_per_round, args.prefill_tokens)
        for name in order:
            decode[name] += decode_step_seconds(engines[name], dec_ids, args.decode_steps)
            prefill[name] += [prefill_seconds(engines[name], ids) for ids in pre_ids]
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{n} decode {1e3 * statistics.median(decode[n]):.1f} ms prefill {1e3 * statistics.median(prefill[n]):.0f} ms"
            for n in engines) + f", load {os.getloadavg()[0]:.1f}", flush=True)

    def summary(xs: list[float]) -> dict:
        return {"median_ms": 1e3 * statistics.median(xs), "p10_ms": 1e3 * float(np.percentile(xs, 10)),
                "p90_ms": 1e3 * float(np.percentile(xs, 90)), "n": len(xs)}

    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "jax": jax.__version__, "backend": jax.default_backend(), "cores": os.cpu_count(),
              "loadavg": os.getloadavg(), "preset": args.preset, "args": vars(args),
              "num_pages": engines["scan"].settings.num_pages,
              "greedy_tokens_equal": same,
              "decode_16_seqs_step": {n: summary(decode[n]) for n in engines},
              "prefill_step": {n: summary(prefill[n]) for n in engines},
              "engine_stats": {n: {k: v for k, v in e.stats().items() if isinstance(v, (int, float, str))}
                               for n, e in engines.items()}}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("decode_16_seqs_step", "prefill_step")}, indent=1))


if __name__ == "__main__":
    main()
