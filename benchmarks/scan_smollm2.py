"""Layers unrolled vs `engine.scan_layers` on the real SmolLM2-135M-Instruct (its Q4_1 GGUF,
which tests/test_gguf_smollm2.py fetches) in its default bf16: build + warm-up seconds and
decode ms/token at batch 1 and 8, both engines in one process taking turns (the order flips
every round), medians of 3; (t(33 tokens) - t(1 token)) / 32 per generate, so prefill and
per-call costs cancel. Also whether the two give the same greedy tokens.

    python benchmarks/scan_smollm2.py [--gguf PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from jaxfill.engine.config import load_config
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams

DEFAULT = os.path.expanduser("~/.cache/jaxfill/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
BASE = {"engine.num_pages": 256, "engine.token_buckets": [16, 64], "engine.max_num_batched_tokens": 64,
        "engine.max_num_seqs": 16, "engine.max_model_len": 2048, "engine.enable_prefix_caching": False}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=DEFAULT)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    engines = {}
    for name, scan in (("unrolled", False), ("scan", True)):
        t = time.time()
        engines[name] = Engine(load_config(None, {**BASE, "engine.scan_layers": scan}, args.gguf), progress=False)
        print(name, "built + warmed up in", round(time.time() - t, 1), "s", flush=True)
    prompt = engines["scan"].tokenizer.encode("The capital of France is")
    ms = {n: {1: [], 8: []} for n in engines}
    tokens = {}
    for r in range(args.rounds):
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            for b in (1, 8):
                prompts = [prompt + [i] for i in range(b)]
                t0 = time.perf_counter()
                engines[name].generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
                one = time.perf_counter() - t0
                t0 = time.perf_counter()
                out = engines[name].generate(prompts, SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True))
                ms[name][b].append((time.perf_counter() - t0 - one) / 32 * 1e3)
                tokens[name, b] = [o.token_ids for o in out]
    print("decode ms/token:", {n: {b: round(statistics.median(v), 1) for b, v in d.items()} for n, d in ms.items()},
          "load", round(os.getloadavg()[0], 1))
    print("same greedy tokens:", all(tokens["unrolled", b] == tokens["scan", b] for b in (1, 8)))


if __name__ == "__main__":
    main()
