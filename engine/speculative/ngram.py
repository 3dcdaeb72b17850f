"""Prompt-lookup (n-gram) proposals: no draft model, just the request's own tokens.

Repetitive text (code edits, quoting the prompt, lists) often continues the way an
earlier occurrence of its last few tokens did; proposing those continuations costs a
host-side search and is free to be wrong, since the target model verifies every one.
"""

from __future__ import annotations

from typing import Sequence


def propose_ngram(tokens: Sequence[int],  # [n] prompt + output ids
                  k: int, ngram_max: int, ngram_min: int) -> list[int]:  # [<= k]
    """Up to k tokens that followed the most recent earlier occurrence of the last n
    tokens of `tokens` (prompt + output) that is followed by k tokens (else the most recent
    longest shorter continuation), trying n = ngram_max down to ngram_min; [] when none
    occurs. Longer n first: a longer match predicts its continuation better."""
    size = len(tokens)
    if k <= 0:
        return []
    toks = list(tokens)
    for n in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        tail = toks[size - n:]
        best: list[int] = []
        for start in range(size - n - 1, -1, -1):  # most recent first; never the tail itself
            if toks[start:start + n] == tail:
                follow = toks[start + n:start + n + k]
                if len(follow) == k:
                    return follow
                if len(follow) > len(best):  # a match near the end has a short continuation: keep looking
                    best = follow
        if best:
            return best
    return []
