"""Speculative decoding benchmark, in process: decode tokens/s at batch 1 with and without
n-gram proposals (speculative.method = ngram) on (a) a prompt that repeats itself and (b)
one that does not, medians of --repeats interleaved runs side by side, plus the acceptance stats. "off_sync"
is the synchronous engine without proposals (speculation steps synchronously).

    python benchmarks/spec_decode.py [--config tiny_random] [--tokens 128] [--repeats 5] [--out ...]

On tiny_random (random weights) greedy output falls into repetition, so proposals are
accepted on both prompts once it does: the numbers show the verification step's cost
and what acceptance buys on this host, not what a trained model's text would see.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxfill.engine.config import load_config  # noqa: E402
from jaxfill.engine.engine import Engine  # noqa: E402
from jaxfill.engine.loading import build_model  # noqa: E402
from jaxfill.engine.request import SamplingParams  # noqa: E402

COMMON = {"engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64], "engine.num_pages": 128,
          "engine.max_model_len": 1024, "engine.max_num_seqs": 4, "engine.enable_prefix_caching": False}
SPEC = {"speculative.method": "ngram", "speculative.num_tokens": 4}


def prompts(vocab: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(0)
    return {"a_repeating": rng.integers(0, vocab, 16).tolist() * 8,
            "b_non_repeating": rng.permutation(vocab)[:128].tolist()}


def decode_rate(eng: Engine, prompt: list[int], tokens: int) -> float:
    """Decode tokens/s of one greedy request: (tokens - 1) over the time after its first token."""
    eng.add_request(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True), request_id="r")
    first = done = None
    n = n0 = 0
    while eng.has_unfinished():
        for o in eng.step():
            n += len(o.new_token_ids)
            if first is None and n:
                first = time.perf_counter()
                n0 = n
            if o.finished:
                done = time.perf_counter()
    return (n - n0) / (done - first)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="tiny_random")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "spec_decode.json"))
    a = ap.parse_args()
    model = build_model(load_config(a.config, COMMON), progress=False)
    engines = {name: Engine(load_config(a.config, {**COMMON, **extra}), progress=False, model=model)
               for name, extra in (("off", {}), ("off_sync", {"engine.async_scheduling": False}), ("ngram", SPEC))}
    results = {}
    for pname, prompt in prompts(load_config(a.config, COMMON).model.vocab_size).items():
        for eng in engines.values():
            decode_rate(eng, prompt, a.tokens)  # compiles every program the runs use
        before = {name: eng.stats() for name, eng in engines.items()}
        rates = {name: [] for name in engines}
        for _ in range(a.repeats):  # interleaved, so a busy host slows both alike
            for name, eng in engines.items():
                rates[name].append(decode_rate(eng, prompt, a.tokens))
        row = {}
        for name, eng in engines.items():
            st = eng.stats()
            row[name] = {"decode_tok_s_median": statistics.median(rates[name]), "runs": rates[name]}
            if "spec_proposed_tokens" in st:
                b = before[name]
                prop = st["spec_proposed_tokens"] - b["spec_proposed_tokens"]
                acc = st["spec_accepted_tokens"] - b["spec_accepted_tokens"]
                ver = st["spec_verifications"] - b["spec_verifications"]
                row[name].update(proposed=prop, accepted=acc, mean_acceptance_length=(acc + ver) / max(ver, 1))
        row["speedup"] = row["ngram"]["decode_tok_s_median"] / row["off"]["decode_tok_s_median"]
        results[pname] = row
        print(pname, json.dumps({k: (v if k == "speedup" else {x: y for x, y in v.items() if x != "runs"})
                                 for k, v in row.items()}), flush=True)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"config": a.config, "tokens": a.tokens, "repeats": a.repeats, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
