"""The engine on a GPU: Llama-3-8B-shaped bf16 prefill and decode through Engine.generate.

Run by benchmarks/gpu_kernels.sh. Random weights (the `llama3_8b` preset's published
shape; no download). Prefill of one prompt at 2k, 8k and 32k tokens: TTFT (median of 3
after a warm-up run), prompt tokens/s and MFU against 989 TFLOP/s (H100/H200 dense bf16),
counting 2 x matmul params per token plus causal attention. Decode: 64 sequences of 128
prompt tokens, 64 new tokens each: generated tokens/s. Writes $OUT/engine_gpu.json after
every case, so a time-out still leaves what was measured. `--dry-run`: the tiny_random
preset at 64 tokens on any backend, to check this script's own logic (CI does).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import jax
import numpy as np

from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams

DRY = "--dry-run" in sys.argv
OUT = os.environ.get("OUT") or "benchmarks/results"
DEADLINE = time.time() + float(os.environ.get("BUDGET_S", "200"))
PEAK_TFLOPS = 989.0  # dense bf16, H100 SXM / H200
PRESET, LENGTHS = ("tiny_random", (64,)) if DRY else ("llama3_8b", (2048, 8192, 32768))
DECODE_SEQS, DECODE_PROMPT, DECODE_NEW = (4, 16, 8) if DRY else (64, 128, 64)


def flops_per_prompt(config, n: int) -> float:
    """2 x matmul params per token (embedding lookup excluded) + causal QK^T and PV."""
    m = config.model
    attn = 2 * m.hidden_size * m.num_heads * m.head_dim + 2 * m.hidden_size * m.num_kv_heads * m.head_dim
    mlp = 3 * m.hidden_size * m.intermediate_size
    matmul = m.num_layers * (attn + mlp) + m.hidden_size * m.vocab_size / n  # one row of logits
    causal = 4 * m.num_layers * m.num_heads * m.head_dim * n * (n + 1) / 2
    return 2 * matmul * n + causal


def save(result):
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "engine_gpu_dry_run.json" if DRY else "engine_gpu.json"), "w") as f:
        json.dump(result, f, indent=2)


def main():
    longest = max(LENGTHS)
    overrides = {"engine.max_model_len": longest + 64, "engine.max_num_batched_tokens": longest,
                 "engine.token_buckets": sorted({*LENGTHS, 16 if DRY else 128}),
                 "engine.max_num_seqs": DECODE_SEQS, "engine.enable_prefix_caching": False,
                 "model.max_position_embeddings": longest + 64}
    if DRY:
        overrides["engine.num_pages"] = 64
    t0 = time.perf_counter()
    engine = Engine.from_config(PRESET, overrides=overrides, progress=True)
    result = {"preset": PRESET, "device": str(jax.devices()[0]), "jax": jax.__version__,
              "start_s": time.perf_counter() - t0, "attention_impl": engine.stats()["attention_impl"],
              "prefill": [], "decode": None}
    save(result)
    rng = np.random.default_rng(0)
    vocab = engine.config.model.vocab_size
    for n in LENGTHS:
        if time.time() > DEADLINE:
            result["prefill"].append({"tokens": n, "error": "skipped: time budget"})
            break
        prompt = [int(t) for t in rng.integers(10, vocab, n)]
        times = []
        for _ in range(4):  # the first run compiles nothing new (warm-up did) but pays first-touch
            t = time.perf_counter()
            engine.generate([prompt], SamplingParams(max_tokens=1))
            times.append(time.perf_counter() - t)
        ttft = statistics.median(times[1:])
        flops = flops_per_prompt(engine.config, n)
        row = {"tokens": n, "ttft_s": ttft, "runs_s": times, "prompt_tok_s": n / ttft,
               "tflops": flops / ttft / 1e12, "mfu": flops / ttft / 1e12 / PEAK_TFLOPS}
        result["prefill"].append(row)
        print(f"prefill {n:6d} tokens: TTFT {ttft * 1e3:9.1f} ms  {n / ttft:9.0f} tok/s  "
              f"MFU {row['mfu']:.1%}", flush=True)
        save(result)
    if time.time() < DEADLINE:
        prompts = [[int(t) for t in rng.integers(10, vocab, DECODE_PROMPT)] for _ in range(DECODE_SEQS)]
        params = SamplingParams(max_tokens=DECODE_NEW, ignore_eos=True)
        engine.generate(prompts, params)  # warm
        t = time.perf_counter()
        done = engine.generate(prompts, params)
        dt = time.perf_counter() - t
        new = sum(len(c.token_ids) for c in done)
        result["decode"] = {"seqs": DECODE_SEQS, "prompt": DECODE_PROMPT, "new_tokens": new,
                            "seconds": dt, "tok_s": new / dt}
        print(f"decode {DECODE_SEQS} x {DECODE_NEW}: {new / dt:.0f} tok/s (prefill included)", flush=True)
        save(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
