"""Host cost of one proposal: suffix decoding vs prompt lookup, on a long history.

    python benchmarks/spec_suffix_cost.py [--history 8000] [--steps 400]

Every speculating decode proposes once per step on the host, so this is time added to each
step per running request. The history is `--history` tokens of Zipf-distributed ids (vocab
49152, the commonest id ~3% of tokens, as punctuation and whitespace are in real text, so
the newest token often has hundreds of earlier places) in which a third of the text copies earlier spans
(an edit repeating its input). Each timed step appends one token and proposes (k = 4), as
a decode does: suffix with its history synced incrementally, ngram on prompt + output as
the scheduler passes it. Suffix is timed with the global cache empty and full
(speculative.suffix_cache_tokens of other outputs). Prints ms per proposal (median, p90, max).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(ROOT))

from jaxfill.engine.config import SpeculativeSettings  # noqa: E402
from jaxfill.engine.speculative.ngram import propose_ngram  # noqa: E402
from jaxfill.engine.speculative.suffix import History, SuffixProposer  # noqa: E402


VOCAB = 49152
ZIPF = 1.0 / (np.arange(VOCAB) + 3.7)  # rank r's share ~ 1 / (r + 2.7): the commonest id ~3% of tokens
ZIPF /= ZIPF.sum()


def text(rng, n: int) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        if len(out) > 64 and rng.random() < 0.33:
            start = int(rng.integers(0, len(out) - 32))
            out += out[start:start + int(rng.integers(8, 32))]
        else:
            out += rng.choice(VOCAB, 16, p=ZIPF).tolist()
    return out[:n]


def timed(fn, steps: int) -> list[float]:
    ms = []
    for i in range(steps):
        t = time.perf_counter()
        fn(i)
        ms.append(1e3 * (time.perf_counter() - t))
    return ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--history", type=int, default=8000)
    ap.add_argument("--steps", type=int, default=400)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    toks = text(rng, a.history + a.steps)
    prompt, out0 = toks[:a.history // 2], a.history - a.history // 2
    settings = SpeculativeSettings(method="suffix")
    rows = {}
    for name, cache in (("suffix, cache empty", 0), ("suffix, cache full", settings.suffix_cache_tokens)):
        prop = SuffixProposer(settings)
        while prop.cache.size < cache - 600:
            prop.finished(text(rng, 500))
        hist, output = History(), toks[a.history // 2:a.history]
        prop.propose(hist, prompt, output, 4)  # the first sync copies the history
        rows[name] = timed(lambda i: output.append(toks[a.history + i]) or prop.propose(hist, prompt, output, 4),
                           a.steps)
    output = toks[a.history // 2:a.history]
    rows["ngram (ngram_max 4, ngram_min 2)"] = timed(
        lambda i: output.append(toks[a.history + i]) or propose_ngram(prompt + output, 4, 4, 2), a.steps)
    print(f"history {a.history} tokens ({a.history // 2} prompt + {out0} output), {a.steps} steps, load "
          f"{os.getloadavg()[0]:.1f}")
    for name, ms in rows.items():
        ms.sort()
        print(f"{name:36s} median {statistics.median(ms):.3f} ms, p90 {ms[int(0.9 * len(ms))]:.3f} ms, "
              f"max {ms[-1]:.3f} ms")


if __name__ == "__main__":
    main()
