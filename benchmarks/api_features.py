"""n samples and prompt scoring (issue 30), side by side in one run, on the tiny preset.

(A) SamplingParams(n=8) against 8 separate requests of the same prompt (the same seeds:
    seed + i), temperature 1, ignore_eos, max_tokens 16, a ~500-token prompt, prefix
    caching on. The prefix cache is reset before every run of both cases (so neither
    hits a previous repetition's pages); the 8 separate requests are submitted together
    and can still share pages if one has published its prompt pages before another is
    admitted: each completion's cached_tokens says whether that happened. The engine is
    driven by add_request + step() here; between steps the harness polls
    stats()["pages_total"] - stats()["pages_free"] (pages held by live requests; evictable
    cached pages count as free) and keeps the peak. Per run: prompt tokens computed
    (sum of prompt_tokens - cached_tokens), TTFT (Completion.metrics["ttft_s"]: arrival to
    first token) median over the 8 samples and max, wall time from the first add_request
    to the last finished output, engine steps, peak KV pages.
(B) Scoring throughput: 4 texts of 2048 tokens (BOS + 2047 bytes of four plays in
    configs/tiny/corpus; the byte tokenizer is 1 byte = 1 token) scored with
    SamplingParams(max_tokens=1, prompt_logprobs=0) (engine.max_num_batched_tokens 512,
    engine.prompt_logprobs_rows 512, engine.max_model_len 2304), against transformers
    on the same checkpoint (configs/tiny, float32, one batched forward [4, 2048] +
    log_softmax + gather, torch.no_grad, torch.set_num_threads(2)), and against the same
    jaxfill engine prefilling the texts without prompt_logprobs (the cost of scoring).
    Prompt tokens/s over all 4 x 2048 tokens; jaxfill's first run of each kind (the
    compile of the step and scoring programs) is a warm-up and not counted, and so is
    transformers' first forward. The two sets of logprobs are compared: max |difference|
    over every scored token must be < 1e-4.

The cases are interleaved repetition by repetition (so drift in the machine's load hits
all of them) and reported as medians, with [min, max] ("spread"), ratios of each
repetition against the other case of the same repetition ("paired_ratios") and the
1-minute load average at the start, at (B) and at the end (the machine is shared).

    python benchmarks/api_features.py [--reps-a 15] [--reps-b 15] [--replot]
        -> benchmarks/results/api_features.json, api_features.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxfill.engine.config import load_config  # noqa: E402
from jaxfill.engine.engine import Engine  # noqa: E402
from jaxfill.engine.request import SamplingParams  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
CORPUS = os.path.join(ROOT, "configs", "tiny", "corpus")
TINY_DIR = os.path.join(ROOT, "configs", "tiny")
PLAYS = ("hamlet.txt", "macbeth.txt", "othello.txt", "king-lear.txt")
BOS = 256
CASES_A = ("n=8", "8 separate")
CASES_B = ("jaxfill scoring", "jaxfill prefill only", "transformers scoring")


def corpus_ids(play: str, offset: int, length: int) -> list[int]:
    """BOS + `length` bytes of a play (ASCII): the byte tokenizer's ids, no tokenizer needed."""
    with open(os.path.join(CORPUS, play), "rb") as f:
        data = f.read()
    chunk = data[offset:offset + length]
    assert len(chunk) == length and all(b < 128 for b in chunk)
    return [BOS] + list(chunk)


# ---------------------------------------------------------------------------------- (A)
def run_samples(engine: Engine, case: str, prompt: list[int], args, seed: int) -> dict:
    bm = engine.scheduler.replicas[0].bm
    bm.reset_prefix_cache()  # neither case hits a previous repetition's pages
    base = dict(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)
    st = engine.stats()
    assert st["num_running"] == 0 and st["pages_total"] - st["pages_free"] == 0
    steps0 = engine.num_steps
    start = time.perf_counter()
    if case == "n=8":
        engine.add_request(prompt, SamplingParams(n=args.n, seed=seed, **base))
    else:
        for i in range(args.n):
            engine.add_request(prompt, SamplingParams(seed=seed + i, **base))
    done, peak, peak_lists, first_token_step, trace = [], 0, 0, {}, []
    names: dict[str, int] = {}  # request id -> 0..n-1 in the order added
    real = engine.scheduler.schedule

    def traced():  # records each step's prompt chunks: (sample, first position, tokens)
        scheds = real()
        chunks = []
        for sch in (x for sc in scheds for x in sc.seqs):
            if sch.start < len(sch.req.prompt_ids):
                chunks.append((names.setdefault(sch.req.request_id, len(names)), sch.start, sch.num_new))
        trace.append(chunks)
        return scheds
    for r in engine.requests.values():  # the order added (dicts keep it)
        names.setdefault(r.request_id, len(names))
    engine.scheduler.schedule = traced
    try:
        while engine.has_unfinished():
            for o in engine.step():
                if o.new_token_ids and o.request_id not in first_token_step:
                    first_token_step[o.request_id] = engine.num_steps - steps0  # the step whose results had it
                if o.finished:
                    done.append(o.completion)
            st = engine.stats()
            peak = max(peak, st["pages_total"] - st["pages_free"])
            # the same from the live requests' page lists (a shared page counted once)
            peak_lists = max(peak_lists, len({pg for r in engine.requests.values() for pg in r.pages}))
    finally:
        del engine.scheduler.schedule
    wall = time.perf_counter() - start
    assert len(done) == args.n and all(c.finish_reason == "length" for c in done), [c.finish_reason for c in done]
    done.sort(key=lambda c: (c.index, c.request_id))
    ttft = [c.metrics["ttft_s"] for c in done]
    return {"wall_s": wall, "steps": engine.num_steps - steps0,
            "prompt_tokens_computed": sum(c.prompt_tokens - c.cached_tokens for c in done),
            "cached_tokens": [c.cached_tokens for c in done],
            "ttft_median_s": statistics.median(ttft), "ttft_max_s": max(ttft), "ttft_s": ttft,
            "first_token_step": sorted(first_token_step.values()),
            "peak_pages": peak, "peak_pages_from_page_lists": peak_lists,
            # steps (1-based, dispatch order) that carried prompt chunks: [step, [[sample, start, tokens], ...]]
            "prefill_chunks_per_step": [[i + 1, c] for i, c in enumerate(trace) if c],
            "output_tokens": sum(len(c.token_ids) for c in done),
            "outputs": [c.token_ids for c in done]}


def expected_pages(prompt_len: int, max_tokens: int, n: int, page_size: int) -> dict:
    """Pages if every sample runs at once: shared full prompt pages + own tail pages, or all own."""
    per = -(-(prompt_len + max_tokens) // page_size)  # a sample's pages at its end
    shared = prompt_len // page_size
    return {"pages_per_sample": per, "shared_prompt_pages": shared,
            "n_samples_sharing": shared + n * (per - shared), "separate_no_sharing": n * per}


# ---------------------------------------------------------------------------------- (B)
def run_jaxfill_scoring(engine: Engine, texts: list[list[int]], scoring: bool) -> tuple[dict, list]:
    engine.scheduler.replicas[0].bm.reset_prefix_cache()  # prefix caching is off there; belt and braces
    p = SamplingParams(max_tokens=1, prompt_logprobs=0 if scoring else None)
    steps0 = engine.num_steps
    start = time.perf_counter()
    done = engine.generate(texts, p)
    wall = time.perf_counter() - start
    tokens = sum(len(t) for t in texts)
    assert all(c.cached_tokens == 0 for c in done)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "steps": engine.num_steps - steps0}, done


def hf_scorer(threads: int):
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(TINY_DIR, dtype=torch.float32)
    model.eval()

    def score(texts: list[list[int]]):
        ids = torch.tensor(texts)
        with torch.no_grad():
            logits = model(ids).logits.float()
            lp = torch.log_softmax(logits[:, :-1], -1)
            return torch.gather(lp, 2, ids[:, 1:, None])[..., 0].numpy()  # [B, T - 1]
    return score, torch.__version__, transformers.__version__


def run_hf(score, texts: list[list[int]]) -> tuple[dict, object]:
    start = time.perf_counter()
    lp = score(texts)
    wall = time.perf_counter() - start
    tokens = sum(len(t) for t in texts)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall}, lp


def max_abs_diff(done, texts, hf_lp) -> float:
    import numpy as np

    worst = 0.0
    for c, ids, ref in zip(done, texts, hf_lp):
        entries = c.prompt_logprobs
        assert len(entries) == len(ids) and entries[0] is None
        assert [e["token_id"] for e in entries[1:]] == ids[1:]
        ours = np.array([e["logprob"] for e in entries[1:]])
        worst = max(worst, float(np.max(np.abs(ours - ref))))
    return worst


# ---------------------------------------------------------------------------------- plot
def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    a, b = result["A"]["median"], result["B"]["median"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ax = axes[0]
    xs = np.arange(len(CASES_A))
    ax.bar(xs - 0.2, [a[c]["ttft_median_s"] * 1e3 for c in CASES_A], 0.4, label="TTFT, median of 8 samples")
    ax.bar(xs + 0.2, [a[c]["ttft_max_s"] * 1e3 for c in CASES_A], 0.4, label="TTFT, max of 8")
    for x, c in zip(xs, CASES_A):
        ax.annotate(f"wall {a[c]['wall_s'] * 1e3:.0f} ms", (x, a[c]["ttft_max_s"] * 1e3), ha="center",
                    va="bottom", fontsize=8)
    ax.set_xticks(xs, CASES_A)
    ax.set_ylabel("ms (median over repetitions)")
    ax.set_ylim(0, 1.25 * max(a[c]["ttft_max_s"] * 1e3 for c in CASES_A))
    ax.set_title(f"(A) {result['A']['prompt_tokens']}-token prompt, 8 samples x {result['A']['max_tokens']} "
                 "tokens", fontsize=10)
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.bar(xs - 0.2, [a[c]["prompt_tokens_computed"] for c in CASES_A], 0.4, color="C2",
           label="prompt tokens computed")
    ax.set_ylabel("prompt tokens computed (sum over samples)")
    ax2 = ax.twinx()
    ax2.bar(xs + 0.2, [a[c]["peak_pages"] for c in CASES_A], 0.4, color="C3", label="peak KV pages")
    ax2.set_ylabel("peak KV pages held (16 tokens each)")
    for x, c in zip(xs, CASES_A):
        ax.annotate(f"{a[c]['prompt_tokens_computed']:.0f}", (x - 0.2, a[c]["prompt_tokens_computed"]),
                    ha="center", va="bottom", fontsize=8)
        ax2.annotate(f"{a[c]['peak_pages']:.0f}", (x + 0.2, a[c]["peak_pages"]), ha="center", va="bottom",
                     fontsize=8)
    ax.set_xticks(xs, CASES_A)
    ax.set_ylim(0, 1.2 * max(a[c]["prompt_tokens_computed"] for c in CASES_A))
    ax2.set_ylim(0, 1.2 * max(a[c]["peak_pages"] for c in CASES_A))
    ax.set_title("(A) prefill work and KV pages", fontsize=10)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
    ax = axes[2]
    xs = np.arange(len(CASES_B))
    vals = [b[c]["tokens_per_s"] for c in CASES_B]
    bars = ax.bar(xs, vals, 0.6, color=["C0", "C7", "C1"])
    for bar, v in zip(bars, vals):
        ax.annotate(f"{v:,.0f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(xs, [c.replace(" ", "\n", 1) for c in CASES_B], fontsize=8)
    ax.set_ylabel("prompt tokens/s (median; compile excluded)")
    ax.set_ylim(0, 1.2 * max(vals))
    ax.set_title(f"(B) scoring {result['B']['num_texts']} x {result['B']['text_tokens']} tokens; "
                 f"max |dlogprob| {result['B']['max_abs_diff']:.1e}", fontsize=10)
    fig.suptitle(f"{result['config']} preset, {result['cpu_count']} CPU cores (mechanics, not accelerator speed)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------------- main
def median_of(rs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rs) for k, v in rs[0].items() if isinstance(v, (int, float))}


def spread_of(rs: list[dict]) -> dict:
    """[min, max] over the repetitions (how noisy the machine was)."""
    return {k: [min(r[k] for r in rs), max(r[k] for r in rs)] for k, v in rs[0].items() if isinstance(v, (int, float))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-bytes", type=int, default=499, help="(A) prompt = BOS + these many bytes")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--reps-a", type=int, default=15)
    p.add_argument("--text-bytes", type=int, default=2047, help="(B) each text = BOS + these many bytes")
    p.add_argument("--num-texts", type=int, default=4)
    p.add_argument("--reps-b", type=int, default=15)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--out", default=os.path.join(RESULTS, "api_features.json"))
    p.add_argument("--replot", action="store_true", help="only redraw --out's plot from its JSON")
    args = p.parse_args()
    if args.replot:
        with open(args.out) as f:
            plot(json.load(f), os.path.splitext(args.out)[0] + ".png")
        return
    t0 = time.perf_counter()
    load = [os.getloadavg()[0]]  # the machine is shared: 1-minute load average at the start, (B), the end

    def log(msg: str) -> None:
        print(f"{msg} [{time.perf_counter() - t0:.0f} s]", file=sys.stderr, flush=True)

    # ---- (A)
    over_a = {"engine.enable_prefix_caching": True, "engine.max_num_seqs": 16}
    eng_a = Engine(load_config(args.config, over_a), progress=False)
    prompt = corpus_ids("romeo-and-juliet.txt", 4000, args.prompt_bytes)
    for case in CASES_A:  # first-call costs (sampler branches, n > 1 paths)
        run_samples(eng_a, case, prompt, args, seed=10_000)
    log("(A) warm-up done")
    runs_a: dict[str, list[dict]] = {c: [] for c in CASES_A}
    for rep in range(args.reps_a):
        for case in (CASES_A if rep % 2 == 0 else CASES_A[::-1]):  # alternate who goes first
            r = run_samples(eng_a, case, prompt, args, seed=1000 * rep)
            runs_a[case].append(r)
            log(f"[A {rep + 1}/{args.reps_a}] {case:10s}: prompt tokens computed {r['prompt_tokens_computed']}, "
                f"cached {r['cached_tokens']}, TTFT median {r['ttft_median_s'] * 1e3:.1f} ms max "
                f"{r['ttft_max_s'] * 1e3:.1f} ms, wall {r['wall_s'] * 1e3:.1f} ms, {r['steps']} steps, "
                f"peak pages {r['peak_pages']}")
    same = all(x["outputs"] == y["outputs"] for x, y in zip(runs_a["n=8"], runs_a["8 separate"]))
    med_a = {c: median_of(rs) for c, rs in runs_a.items()}
    paired = lambda k: statistics.median(y[k] / x[k] for x, y in zip(runs_a["n=8"], runs_a["8 separate"]))  # noqa: E731
    ratios_a = {f"{k}_separate_over_n": paired(k) for k in ("prompt_tokens_computed", "ttft_median_s", "ttft_max_s",
                                                             "wall_s", "peak_pages")}
    s_a = eng_a.settings
    result_a = {"overrides": over_a, "prompt_tokens": len(prompt), "max_tokens": args.max_tokens, "n": args.n,
                "temperature": 1.0, "page_size": s_a.page_size, "max_num_batched_tokens": s_a.max_num_batched_tokens,
                "async_scheduling": s_a.async_scheduling, "max_num_partial_prefills": s_a.max_num_partial_prefills,
                "reps": args.reps_a, "peak_pages_method": "polled stats() pages_total - pages_free after every step()",
                "expected_pages": expected_pages(len(prompt), args.max_tokens, args.n, s_a.page_size),
                "same_tokens_both_cases": same, "runs": runs_a, "median": med_a,
                "spread": {c: spread_of(rs) for c, rs in runs_a.items()}, "paired_ratios": ratios_a}
    eng_a.close()
    del eng_a

    # ---- (B)
    load.append(os.getloadavg()[0])
    over_b = {"engine.max_model_len": 2304, "engine.max_num_batched_tokens": 512,
              "engine.prompt_logprobs_rows": 512, "engine.enable_prefix_caching": False}
    eng_b = Engine(load_config(args.config, over_b), progress=False)
    texts = [corpus_ids(play, 20_000, args.text_bytes) for play in PLAYS[:args.num_texts]]
    score, torch_v, tf_v = hf_scorer(args.threads)
    w = time.perf_counter()
    _, ref_done = run_jaxfill_scoring(eng_b, texts, scoring=True)
    run_jaxfill_scoring(eng_b, texts, scoring=False)
    _, hf_lp = run_hf(score, texts)
    diff = max_abs_diff(ref_done, texts, hf_lp)
    log(f"(B) warm-up (jaxfill compiles, transformers' first forward) {time.perf_counter() - w:.1f} s; "
        f"max |logprob jaxfill - transformers| = {diff:.2e}")
    runs_b: dict[str, list[dict]] = {c: [] for c in CASES_B}
    for rep in range(args.reps_b):
        for case in CASES_B:
            if case == "transformers scoring":
                r, lp = run_hf(score, texts)
            else:
                r, done = run_jaxfill_scoring(eng_b, texts, scoring=case == "jaxfill scoring")
                if case == "jaxfill scoring":
                    diff = max(diff, max_abs_diff(done, texts, hf_lp))
            runs_b[case].append(r)
            log(f"[B {rep + 1}/{args.reps_b}] {case:20s}: {r['tokens']} tokens in {r['wall_s'] * 1e3:.0f} ms = "
                f"{r['tokens_per_s']:,.0f} tokens/s" + (f", {r['steps']} steps" if "steps" in r else ""))
    med_b = {c: median_of(rs) for c, rs in runs_b.items()}
    pairb = lambda x, y: statistics.median(a["tokens_per_s"] / b["tokens_per_s"]  # noqa: E731
                                           for a, b in zip(runs_b[x], runs_b[y]))
    ratios_b = {"jaxfill_scoring_over_transformers": pairb("jaxfill scoring", "transformers scoring"),
                "jaxfill_scoring_over_prefill_only": pairb("jaxfill scoring", "jaxfill prefill only")}
    result_b = {"overrides": over_b, "num_texts": len(texts), "text_tokens": len(texts[0]), "plays": PLAYS[:len(texts)],
                "reps": args.reps_b, "torch": torch_v, "transformers": tf_v, "torch_threads": args.threads,
                "compile_excluded": True, "max_abs_diff": diff, "runs": runs_b, "median": med_b,
                "spread": {c: spread_of(rs) for c, rs in runs_b.items()},
                "paired_ratios": ratios_b}
    mesh = eng_b.runner.mesh
    load.append(os.getloadavg()[0])
    result = {"date": time.strftime("%Y-%m-%d"), "config": args.config, "cpu_count": os.cpu_count(),
              "loadavg_1min_at_start_a_b_end": load,
              "mesh": None if mesh is None else dict(mesh.shape), "A": result_a, "B": result_b,
              "total_s": time.perf_counter() - t0}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.splitext(args.out)[0] + ".png")
    print(json.dumps({"A": {"median": med_a, "paired_ratios": ratios_a, "same_tokens_both_cases": same,
                            "expected_pages": result_a["expected_pages"]},
                      "B": {"median": med_b, "paired_ratios": ratios_b, "max_abs_diff": diff}}, indent=1))
    if diff >= 1e-4:
        raise SystemExit(f"jaxfill and transformers prompt logprobs differ by {diff:.2e} (>= 1e-4)")


if __name__ == "__main__":
    main()
