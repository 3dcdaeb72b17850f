"""Decode ms per step, jaxfill vs transformers, on the real SmolLM2-135M-Instruct (its Q4_1
GGUF, which tests/test_gguf_smollm2.py fetches), greedy, f32, the same tokens asserted.

    python benchmarks/decode_smollm2.py [--gguf PATH] [--batches 1 8 32] [--new 32]
        [--repeats 3] [--configs f32 f32_old ...] [--profile]

One process: transformers (loaded from the same GGUF, so the same f32 values as jaxfill's
dequantized weights) and one jaxfill engine per config, rounds alternating. A batch is B
prompts of --prompt-len real-text tokens each (no padding on either side). The time of one
decode step is (t(1 + new tokens) - t(1 token)) / new, each side's generate timed whole,
so prefill and per-call overheads cancel; the tables quote medians of --repeats and the
ratio to transformers of this run. Engines run from the checkpoint's own engine settings
(engine/checkpoint_settings.py: 64 sequences, decode buckets 1, 2, 4, 8) except a fixed
256-page pool (its default sizes the pool from RAM), no prefix caching (every call
prefills alike) and a 256-token budget, not 8192 (the larger buckets take minutes
to compile on 2 cores and no step here uses them).

Configs: f32 (model.weight_dtype=auto, model.dtype=float32, the default buckets);
f32_old (the same, buckets as before decode buckets existed: 16, 64, 256, ... x4);
f32_1dev (f32 on one CPU device: mesh.cpu_split off, no 2-way tensor split);
int_group (Q4_1 kept packed, dequantized in every step, f32 activations); bf16 (the
GGUF's defaults: int_group weights, bfloat16 activations and pages).

`--profile`: per bucket, the first call's seconds (compile, or the compile cache) and the
median device step of an all-padding batch of that shape; the sampler alone on [S, V]
greedy rows; and where an engine's decode step goes (schedule, build, dispatch, waiting
for the device, update = the host loop per row with detokenizing), medians over decode
steps, async and synchronous. Writes benchmarks/results/decode_smollm2.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "decode_smollm2.json")
DEFAULT = os.path.join(os.path.expanduser("~"), ".cache", "jaxfill", "smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
CONFIGS = {
    "f32": {"model.weight_dtype": "auto", "model.dtype": "float32"},
    "f32_old": {"model.weight_dtype": "auto", "model.dtype": "float32",
                "engine.token_buckets": [16, 64, 256], "engine.decode_buckets": []},
    "f32_1dev": {"model.weight_dtype": "auto", "model.dtype": "float32", "mesh.cpu_split": False},
    "int_group": {"model.weight_dtype": "int_group", "model.dtype": "float32"},
    "bf16": {},
}
COMMON = {"engine.num_pages": 256, "engine.enable_prefix_caching": False, "engine.max_model_len": 2048,
          "engine.max_num_batched_tokens": 256}


def prompts(tokenizer, batch: int, length: int) -> list[list[int]]:
    """B windows of real text (this repo's docs), `length` tokens each, all different."""
    text = ""
    for name in ("README.md", "ARCHITECTURE.md"):
        with open(os.path.join(ROOT, name)) as f:
            text += f.read()
    ids = tokenizer.encode(text)
    assert len(ids) >= 7 * batch + length, "not enough text for the batch"
    return [list(ids[7 * i:7 * i + length]) for i in range(batch)]


def hf_worker(gguf: str, batch: int, prompt_len: int, new: int, repeats: int) -> None:
    """transformers in its own process (so jax's CPU threads in the benchmark process cannot
    slow it): warm, then --repeats timings; prints JSON {ms, tokens}."""
    model = hf_model(gguf)
    ids = json.loads(os.environ["DECODE_PROMPTS"])
    hf_generate(model, ids, new + 1)
    hf_generate(model, ids, 1)
    ms, toks = [], None
    for _ in range(repeats):
        t, toks = step_ms(hf_generate, model, ids, new)
        ms.append(t)
    print("RESULT " + json.dumps({"ms": ms, "tokens": toks}), flush=True)


def hf_run(gguf: str, batch: list[list[int]], new: int, repeats: int) -> tuple[list[float], list[list[int]]]:
    env = {**os.environ, "DECODE_PROMPTS": json.dumps(batch)}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--hf-worker", "--gguf", gguf, "--new", str(new),
                          "--repeats", str(repeats)], env=env, capture_output=True, text=True, check=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    r = json.loads(line[len("RESULT "):])
    return r["ms"], r["tokens"]


def hf_model(gguf: str):
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                    dtype=torch.float32)
    return model.eval()


def hf_generate(model, batch: list[list[int]], new: int) -> list[list[int]]:
    import torch

    ids = torch.tensor(batch)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                             min_new_tokens=new, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


def jf_generate(engine, batch: list[list[int]], new: int) -> list[list[int]]:
    from jaxfill.engine.request import SamplingParams

    outs = engine.generate(batch, SamplingParams(max_tokens=new, ignore_eos=True, temperature=0.0))
    return [o.token_ids for o in outs]


def timed(fn, *args) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def step_ms(fn, model, batch, new: int) -> tuple[float, list[list[int]]]:
    """ms of one decode step: (t(1 + new) - t(1)) / new."""
    t_long, toks = timed(fn, model, batch, new + 1)
    t_one, _ = timed(fn, model, batch, 1)
    return 1e3 * (t_long - t_one) / new, toks


def same_tokens(ref: list[list[int]], got: list[list[int]]) -> int:
    """Rows whose greedy tokens differ (0 expected: f32 on both sides)."""
    return sum(a != b for a, b in zip(ref, got))


def bucket_profile(engine, repeats: int, max_tokens: int = 64) -> list[dict]:
    """Buckets up to `max_tokens` (the decode-sized ones; the big ones take minutes to compile)."""
    runner = engine.core.runner
    rows = []
    for shape in [x for x in runner.shapes if x[0] <= max_tokens]:
        t0 = time.perf_counter()
        runner.run(runner.dummy(shape)).get()
        first = time.perf_counter() - t0
        ts = []
        for _ in range(max(3, repeats)):
            t0 = time.perf_counter()
            runner.run(runner.dummy(shape)).get()
            ts.append(time.perf_counter() - t0)
        rows.append({"shape": list(shape), "first_s": round(first, 2), "step_ms": round(1e3 * statistics.median(ts), 2)})
    return rows


def sampler_profile(vocab: int, penalty_window: int, rows: list[int]) -> dict:
    import jax
    import numpy as np

    from jaxfill.engine.sampler import sample
    from jaxfill.engine.sampling_rows import empty_sampling

    fn = jax.jit(sample)
    out = {}
    for s in rows:
        logits = jax.numpy.asarray(np.random.default_rng(0).standard_normal((s, vocab), np.float32))
        sp = empty_sampling(s, penalty_window, vocab)
        jax.block_until_ready(fn(logits, sp))
        ts = []
        for _ in range(20):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(logits, sp))
            ts.append(time.perf_counter() - t0)
        out[s] = round(1e3 * statistics.median(ts), 3)
    return out


def phase_profile(engine, batch, new: int, async_scheduling: bool) -> dict:
    """Medians over the decode steps (every row one token) of each phase, in ms."""
    core = engine.core
    phases, runner = core._phases, core.runner
    times: dict[str, list[float]] = {}
    step_rows = []

    def wrap(obj, name, key):
        orig = getattr(obj, name)

        def inner(*a, **k):
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                times.setdefault(key, []).append(time.perf_counter() - t0)
        setattr(obj, name, inner)
        return orig

    orig_run = runner.run

    def run(b):
        pending = orig_run(b)
        get = pending.get

        def timed_get():
            t0 = time.perf_counter()
            try:
                return get()
            finally:
                times.setdefault("device_wait", []).append(time.perf_counter() - t0)
        pending.get = timed_get
        step_rows.append(b.shape)
        return pending
    saved = {n: wrap(phases, n, n) for n in ("schedule", "build", "run", "update")}
    runner.run = run
    step_orig = core.step

    def step():
        t0 = time.perf_counter()
        out = step_orig()
        times.setdefault("step", []).append(time.perf_counter() - t0)
        return out
    core.step = step
    was = core.async_scheduling
    core.async_scheduling = async_scheduling
    try:
        jf_generate(engine, batch, new + 1)
    finally:
        core.async_scheduling = was
        for n, f in saved.items():
            setattr(phases, n, f)
        runner.run = orig_run
        core.step = step_orig
    # decode steps: drop the first two steps (prefill and the step after it) and the last (drain)
    def med(key):
        xs = times.get(key, [])[2:-1]
        return round(1e3 * statistics.median(xs), 3) if xs else None
    return {k: med(k) for k in ("step", "schedule", "build", "run", "device_wait", "update")} | {
        "bucket": list(step_rows[-1]) if step_rows else None}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gguf", default=DEFAULT)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--configs", nargs="+", default=["f32_old", "f32"], choices=sorted(CONFIGS))
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.hf_worker:
        return hf_worker(args.gguf, 0, args.prompt_len, args.new, args.repeats)

    from jaxfill.engine.engine import Engine

    engines = {}
    for name in args.configs:
        t0 = time.perf_counter()
        engines[name] = Engine.from_config(model_path=args.gguf, overrides={**COMMON, **CONFIGS[name]},
                                           progress=False)
        print(f"{name}: built in {time.perf_counter() - t0:.1f} s; buckets {engines[name].core.runner.shapes}",
              flush=True)
    tok = next(iter(engines.values())).tokenizer
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": os.getloadavg(),
              "new_tokens": args.new, "prompt_len": args.prompt_len, "batches": {}}
    for b in args.batches:
        batch = prompts(tok, b, args.prompt_len)
        ms: dict[str, list[float]] = {n: [] for n in (([] if args.no_hf else ["transformers"]) + list(engines))}
        toks: dict[str, list] = {}
        for n, e in engines.items():  # warm: compiles, first-call costs
            jf_generate(e, batch, args.new + 1)
            jf_generate(e, batch, 1)
        for r in range(2):  # transformers before and after jaxfill's rounds, each its own process
            if not args.no_hf:
                t, toks["transformers"] = hf_run(args.gguf, batch, args.new, max(1, args.repeats // 2 + r % 2))
                ms["transformers"] += t
            if r == 1:
                break
            for k in range(args.repeats):
                for n, e in (list(engines.items()) if k % 2 == 0 else list(engines.items())[::-1]):
                    t, toks[n] = step_ms(jf_generate, e, batch, args.new)
                    ms[n].append(t)
        ref = toks.get("transformers") or toks[args.configs[0]]
        row = {}
        for n in ms:
            row[n] = {"ms": round(statistics.median(ms[n]), 2), "all_ms": [round(x, 2) for x in ms[n]],
                      "rows_differing": same_tokens(ref, toks[n])}
            if not args.no_hf:
                row[n]["vs_hf"] = round(statistics.median(ms[n]) / statistics.median(ms["transformers"]), 3)
        for n in engines:
            if n.startswith("f32") and not args.no_hf:
                assert row[n]["rows_differing"] == 0, f"{n} batch {b}: greedy tokens differ from transformers"
        result["batches"][b] = row
        print(f"batch {b}: " + ", ".join(f"{n} {v['ms']} ms" + (f" ({v['vs_hf']}x)" if "vs_hf" in v else "")
                                         + (f" [{v['rows_differing']} rows differ]" if v["rows_differing"] else "")
                                         for n, v in row.items()), flush=True)
    if args.profile:
        result["profile"] = {}
        for n, e in engines.items():
            prof = {"buckets": bucket_profile(e, args.repeats), "phases": {}}
            for b in args.batches:
                batch = prompts(tok, b, args.prompt_len)
                prof["phases"][b] = {"async": phase_profile(e, batch, args.new, True),
                                     "sync": phase_profile(e, batch, args.new, False)}
            result["profile"][n] = prof
            print(n, json.dumps(prof), flush=True)
        s = next(iter(engines.values())).core.runner.config.engine
        result["sampler_ms"] = sampler_profile(e.core.runner.config.model.vocab_size, s.penalty_window,
                                               sorted({1, 8, 16, 32, 64} | set(args.batches)))
        print("sampler ms", result["sampler_ms"], flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
