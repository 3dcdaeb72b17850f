"""Structured output (issue 30): the step-time cost of constrained rows, side by side in one run.

16 concurrent decode requests on one engine (engine.max_num_seqs = 16), the same prompt,
max_tokens 64; 0, 1 or all 16 of them constrained by a regex that cannot end before
max_tokens ([a-z ]{64}), each with engine.async_scheduling off and on. The cases are
interleaved repetition by repetition (so drift in the machine's load hits all of them)
and reported as medians.

Per run: wall time of the step() loop (prefill of the 16 short prompts included, the
same in every case), engine steps, ms per step, ms per output token, output tokens/s,
per-row TPOT and e2e (Completion.metrics) of the constrained and unconstrained rows, and
the host time inside the grammar: `fill_bitmask` (the matcher writes a row's mask into
the batch) and `advance` (the matcher takes a recorded token), timed by wrapping the two
functions where engine/batch.py and engine/scheduler/transitions.py call them (harness
only; the engine is unchanged). build_batch is timed the same way for scale.

Async scheduling: a constrained row's next mask needs its previous token, so it is never
given a decode while a token of it is in flight (engine/scheduler/batching.py): it
decodes every other step while the unconstrained rows decode every step.

    python benchmarks/structured_output.py [--reps 30] [--tokens 64]
        -> benchmarks/results/structured_output.json, structured_output.png
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jaxfill.engine.batch as batch_mod  # noqa: E402
import jaxfill.engine.step_phases as step_phases  # noqa: E402
import jaxfill.engine.scheduler.transitions as transitions_mod  # noqa: E402
from jaxfill.engine.config import load_config  # noqa: E402
from jaxfill.engine.engine import Engine  # noqa: E402
from jaxfill.engine.request import SamplingParams, StructuredOutput  # noqa: E402
from jaxfill.engine.structured_output import bitmask_words  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
OVERRIDES = {"engine.max_num_seqs": 16}
CONSTRAINED = (0, 1, 16)
# bitmask sizes to report (computed, not measured): [S, ceil(V / 32)] int32 every step
BITMASK_SHAPES = [("tiny", 16, 320), ("Llama-3 vocab, 256 rows", 256, 128256)]


class HostTimer:
    """Seconds and calls inside a module-level function, by wrapping it where it is called."""

    def __init__(self, module, name: str):
        self.module, self.name, self.real = module, name, getattr(module, name)
        self.seconds, self.calls = 0.0, 0

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return self.real(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t
                self.calls += 1

        setattr(module, name, timed)

    def reset(self):
        self.seconds, self.calls = 0.0, 0


def run_once(engine: Engine, n_constrained: int, args, timers: dict[str, HostTimer]) -> dict:
    so = StructuredOutput("regex", f"[a-z ]{{{args.tokens}}}")
    ids = {}
    for i in range(args.seqs):
        c = i < n_constrained
        p = SamplingParams(max_tokens=args.tokens, ignore_eos=True, structured_output=so if c else None)
        ids[engine.add_request(args.prompt, p)] = c
    for t in timers.values():
        t.reset()
    steps0, tokens, done = engine.num_steps, 0, []
    start = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            tokens += len(o.new_token_ids)
            if o.finished:
                done.append(o.completion)
    wall = time.perf_counter() - start
    steps = engine.num_steps - steps0
    pattern = re.compile(so.spec)
    rows = {True: [], False: []}
    for comp in done:
        c = ids[comp.request_id]
        if c and not pattern.fullmatch(comp.text):  # the constraint held (else the numbers mean nothing)
            raise AssertionError(f"constrained output {comp.text!r} does not match {so.spec}")
        rows[c].append(comp)
    out = {"wall_s": wall, "steps": steps, "ms_per_step": wall / steps * 1e3, "tokens": tokens,
           "ms_per_token": wall / tokens * 1e3, "tokens_per_s": tokens / wall}
    for c, key in ((True, "constrained"), (False, "unconstrained")):
        if rows[c]:
            out[f"{key}_tpot_ms"] = statistics.median(x.metrics["tpot_s"] for x in rows[c]) * 1e3
            out[f"{key}_e2e_s"] = statistics.median(x.metrics["e2e_s"] for x in rows[c])
            out[f"{key}_tokens"] = statistics.median(len(x.token_ids) for x in rows[c])
    for name, t in timers.items():
        out[f"{name}_ms"] = t.seconds * 1e3
        out[f"{name}_calls"] = t.calls
    out["grammar_ms_per_step"] = (timers["fill_bitmask"].seconds + timers["advance"].seconds) / steps * 1e3
    return out


def bitmask_bytes() -> list[dict]:
    rows = []
    for name, s, v in BITMASK_SHAPES:
        w = bitmask_words(v)
        rows.append({"name": name, "rows": s, "vocab": v, "words": w, "bytes": s * w * 4,
                     # what the sampler unpacks it to when any row is constrained: [S, W, 32] int32
                     "unpacked_bytes": s * w * 32 * 4})
    return rows


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    med = result["median"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = np.arange(len(CONSTRAINED))
    for off, mode, color in ((-0.2, "sync", "C0"), (0.2, "async", "C1")):
        vals = [med[f"{n}/{mode}"]["tokens_per_s"] for n in CONSTRAINED]
        bars = left.bar(xs + off, vals, 0.4, color=color,
                        label=f"async_scheduling={'true' if mode == 'async' else 'false'}")
        for b, n in zip(bars, CONSTRAINED):
            r = med[f"{n}/{mode}"]["tokens_per_s_vs_0_paired"]
            left.annotate(f"{r:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                          fontsize=8)
    left.set_xticks(xs, [f"{n} of {result['seqs']} constrained" for n in CONSTRAINED])
    left.set_ylabel("output tokens/s (median)")
    left.set_ylim(0, 1.2 * max(m["tokens_per_s"] for m in med.values()))
    left.set_title(f"{result['config']}: {result['seqs']} rows x {result['max_tokens']} tokens "
                   f"(labels: vs 0 constrained, same mode)", fontsize=10)
    left.legend(fontsize=8)
    for off, mode, color in ((-0.2, "sync", "C0"), (0.2, "async", "C1")):
        total = [med[f"{n}/{mode}"]["ms_per_step"] for n in CONSTRAINED]
        grammar = [med[f"{n}/{mode}"]["grammar_ms_per_step"] for n in CONSTRAINED]
        right.bar(xs + off, total, 0.4, color=color, label=f"step, {mode}")
        right.bar(xs + off, grammar, 0.4, hatch="//", fill=False,
                  label="of which host time in the grammar (mask + advance)" if mode == "sync" else None)
        for x, n, t in zip(xs + off, CONSTRAINED, total):
            right.annotate(f"{med[f'{n}/{mode}']['steps']:.0f} steps", (x, t), ha="center", va="bottom", fontsize=8)
    right.set_xticks(xs, [f"{n} constrained" for n in CONSTRAINED])
    right.set_ylabel("ms per engine step (median)")
    right.set_ylim(0, 1.3 * max(m["ms_per_step"] for m in med.values()))
    right.set_title("step time; host time in the grammar hatched")
    right.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt", default="ROMEO:\n")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default=os.path.join(RESULTS, "structured_output.json"))
    p.add_argument("--replot", action="store_true", help="only redraw --out's plot from its JSON")
    args = p.parse_args()
    if args.replot:
        with open(args.out) as f:
            plot(json.load(f), os.path.splitext(args.out)[0] + ".png")
        return
    overrides = {**OVERRIDES, "engine.max_num_seqs": args.seqs}
    # each engine loads the (0.8M-parameter) model itself, so the first one sets jax up as
    # Engine.from_config does (one XLA CPU device per core) before anything touches jax
    engines = {mode: Engine(load_config(args.config, {**overrides, "engine.async_scheduling": mode == "async"}),
                            progress=False) for mode in ("sync", "async")}
    mesh = engines["sync"].runner.mesh
    mesh = None if mesh is None else dict(mesh.shape)  # tiny on 2 cores: tensor = 2 (the engine's default split)
    timers = {"fill_bitmask": HostTimer(batch_mod, "fill_bitmask"), "advance": HostTimer(transitions_mod, "advance"),
              "build_batch": HostTimer(step_phases, "build_batch")}
    so = StructuredOutput("regex", f"[a-z ]{{{args.tokens}}}")
    for eng in engines.values():  # first-call costs: the grammar's tokenizer, a matcher, both sampler branches
        eng.generate([args.prompt] * 2, [SamplingParams(max_tokens=4, ignore_eos=True),
                                         SamplingParams(max_tokens=4, structured_output=so)])
    cases = [(n, mode) for n in CONSTRAINED for mode in engines]
    runs: dict[str, list[dict]] = {f"{n}/{mode}": [] for n, mode in cases}
    total = args.reps * len(cases)
    t0 = time.perf_counter()
    for rep in range(args.reps):  # interleaved, so drift in the machine's load hits every case
        for n, mode in cases:
            r = run_once(engines[mode], n, args, timers)
            runs[f"{n}/{mode}"].append(r)
            k = len([x for v in runs.values() for x in v])
            print(f"[{k}/{total}] rep {rep + 1} {n:2d} of {args.seqs} constrained, {mode:5s}: "
                  f"{r['wall_s'] * 1e3:7.1f} ms, {r['steps']} steps, {r['ms_per_step']:.2f} ms/step, "
                  f"{r['tokens_per_s']:.0f} tok/s, fill_bitmask {r['fill_bitmask_ms']:.2f} ms "
                  f"({r['fill_bitmask_calls']} calls), advance {r['advance_ms']:.2f} ms "
                  f"[{time.perf_counter() - t0:.0f} s]", file=sys.stderr, flush=True)
    median = {}
    for key, rs in runs.items():
        median[key] = {k: statistics.median(r[k] for r in rs if k in r) for k in rs[0]}
    for key, m in median.items():
        base = median["0/" + key.split("/")[1]]
        m["tokens_per_s_vs_0"] = m["tokens_per_s"] / base["tokens_per_s"]
        m["ms_per_step_vs_0"] = m["ms_per_step"] / base["ms_per_step"]
        m["wall_vs_0"] = m["wall_s"] / base["wall_s"]
        # paired: each repetition against case (a) of the same repetition, then the median
        rs, bs = runs[key], runs["0/" + key.split("/")[1]]
        m["tokens_per_s_vs_0_paired"] = statistics.median(r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(rs, bs))
        m["ms_per_step_vs_0_paired"] = statistics.median(r["ms_per_step"] / b["ms_per_step"] for r, b in zip(rs, bs))
    result = {"date": time.strftime("%Y-%m-%d"), "config": args.config, "overrides": overrides, "seqs": args.seqs,
              "max_tokens": args.tokens, "prompt": args.prompt, "constraint": so.spec, "reps": args.reps,
              "cpu_count": os.cpu_count(), "mesh": mesh, "bitmask_bytes": bitmask_bytes(), "runs": runs,
              "median": median}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.splitext(args.out)[0] + ".png")
    print(json.dumps({"median": median, "bitmask_bytes": result["bitmask_bytes"]}, indent=1))


if __name__ == "__main__":
    main()
