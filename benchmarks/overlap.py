"""Async scheduling off vs on, side by side in one run: steady decode of 16 sequences.

    python benchmarks/overlap.py [--config bench] [--tokens 64] [--repeats 3] [--out ...]

Host gap: the share of wall time the device sits idle between steps. Each step's
dispatch time is taken as runner.run is called; its completion time by a watcher thread
that blocks on the step's sampled tokens (block_until_ready releases the GIL), in
dispatch order. The device is busy for step k from max(dispatch_k, done_{k-1}) to
done_k; the gap is the rest of the window from the first dispatch to the last
completion. Throughput: generated tokens / wall time of the whole run of step() calls
(prefill of the 16 prompts included, the same in both modes).
On a shared CPU the "device" is the host's own cores, so quote medians and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxfill.engine.config import load_config  # noqa: E402
from jaxfill.engine.engine import Engine  # noqa: E402
from jaxfill.engine.loading import build_model  # noqa: E402
from jaxfill.engine.request import SamplingParams  # noqa: E402

OVERRIDES = {"engine.max_num_seqs": 16, "engine.max_num_batched_tokens": 512, "engine.token_buckets": [16, 512],
             "engine.num_pages": 512, "engine.max_model_len": 1024}


class StepClock:
    """Dispatch and completion times of every step the engine runs."""

    def __init__(self, engine: Engine):
        self.spans: list[tuple[float, float]] = []
        self._q: queue.Queue = queue.Queue()
        real = engine.runner.run

        def run(batch):
            t = time.perf_counter()
            pending = real(batch)
            self._q.put((t, pending._out.tokens))
            return pending

        engine.runner.run = run
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self):
        while True:
            item = self._q.get()
            if item is None:
                return
            t, tokens = item
            tokens.block_until_ready()
            self.spans.append((t, time.perf_counter()))

    def close(self) -> dict:
        self._q.put(None)
        self._thread.join()
        busy, last_done = 0.0, None
        for t, done in self.spans:
            start = t if last_done is None else max(t, last_done)
            busy += max(0.0, done - start)
            last_done = done
        window = self.spans[-1][1] - self.spans[0][0]
        return {"steps": len(self.spans), "window_s": window, "busy_s": busy, "host_gap": 1.0 - busy / window}


def run_once(engine: Engine, prompts, max_tokens: int) -> dict:
    clock = StepClock(engine)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    wall = time.perf_counter() - start
    out = clock.close()
    engine.runner.run = type(engine.runner).run.__get__(engine.runner)
    out.update(tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="bench")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/overlap.json")
    args = ap.parse_args()
    model = build_model(load_config(args.config, OVERRIDES), progress=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, args.prompt_len).tolist() for _ in range(args.seqs)]
    engines = {mode: Engine(load_config(args.config, {**OVERRIDES, "engine.async_scheduling": mode == "on"}),
                            progress=False, model=model) for mode in ("off", "on")}
    for eng in engines.values():
        eng.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # first-call costs
    runs = {"off": [], "on": []}
    for _ in range(args.repeats):  # alternate, so drift in the machine's load hits both
        for mode, eng in engines.items():
            r = run_once(eng, prompts, args.tokens)
            runs[mode].append(r)
            print(mode, json.dumps({k: round(v, 4) for k, v in r.items()}), flush=True)
    summary = {}
    for mode, rs in runs.items():
        summary[mode] = {k: statistics.median(r[k] for r in rs) for k in ("tokens_per_s", "host_gap", "wall_s", "steps")}
    summary["throughput_ratio_on_over_off"] = summary["on"]["tokens_per_s"] / summary["off"]["tokens_per_s"]
    result = {"config": args.config, "overrides": OVERRIDES, "seqs": args.seqs, "prompt_len": args.prompt_len,
              "max_tokens": args.tokens, "repeats": args.repeats, "cpu_count": os.cpu_count(),
              "runs": runs, "median": summary}
    print(json.dumps(summary, indent=2))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
