"""Prompt-lookup (n-gram) proposals: no draft model, just the request's own tokens.

Repetitive text (code edits, quoting the prompt, lists) often continues the way an
earlier occurrence of its last few tokens did; proposing those continuations costs a
host-side search and is free to be wrong, since the target model verifies every one.
The search runs for every speculating decode every step, so it finds the candidate ends
(earlier places of the last token) in one numpy pass and compares n-grams only there.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def propose_ngram(tokens: Sequence[int],  # [n] prompt + output ids
                  k: int, ngram_max: int, ngram_min: int) -> list[int]:  # [<= k]
    """Up to k tokens that followed the most recent earlier occurrence of the last n
    tokens of `tokens` (prompt + output) that is followed by k tokens (else the most recent
    longest shorter continuation), trying n = ngram_max down to ngram_min; [] when none
    occurs. Longer n first: a longer match predicts its continuation better."""
    size = len(tokens)
    if k <= 0 or size < 2:
        return []
    toks = np.asarray(tokens)
    # ends e of earlier occurrences (never the tail itself: e <= size - 2), most recent first
    ends = np.flatnonzero(toks[:size - 1] == toks[-1])[::-1]
    for n in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        tail = toks[size - n:]
        best: list[int] = []
        for e in ends[ends >= n - 1]:
            start = e - n + 1
            if np.array_equal(toks[start:e + 1], tail):
                follow = toks[e + 1:e + 1 + k].tolist()
                if len(follow) == k:
                    return follow
                if len(follow) > len(best):  # a match near the end has a short continuation: keep looking
                    best = follow
        if best:
            return best
    return []
