"""Suffix-decoding proposals: the request's own tokens and recent requests' outputs.

Suffix decoding (Arctic Inference, arXiv 2411.04975; vLLM's `suffix` method) matches the
newest tokens of a request against two histories: the request's prompt + output, and a
global cache of earlier requests' outputs (agent loops and repeated edits produce the same
text across requests, which prompt lookup cannot see). Where the newest m tokens occurred
before, the continuations of all those occurrences vote: the proposal follows the most
frequent next token while the product of the votes' shares (the estimated probability that
the whole prefix is accepted) stays at or above `min_token_prob`, for at most
`spec_factor x m` tokens (a longer match is proposed further) and num_tokens. Each match
length is a candidate; the one with the highest score (the sum of those probabilities: the
expected accepted count) wins, over both histories (of equal scores, the longer match).

The published design keeps suffix trees; here each history is a flat int32 array scanned
with numpy instead (the places of the newest token, then the match lengths narrowed one
position back at a time): no per-token tree nodes to build or evict, memory one int32 per
token, and a proposal costs a few vectorised passes (benchmarks/spec_suffix_cost.py measures
it on an 8000-token history). The global cache holds at most `cache_tokens` tokens; the
oldest requests' outputs go first.
"""

from __future__ import annotations

import collections
from typing import Sequence

import numpy as np

SEP = -1  # between requests in the global cache: never matched, ends a continuation
MAX_LEVELS = 8  # match lengths tried per history (the longest first)
MAX_VOTERS = 256  # occurrences whose continuations vote, the most recent (a common token has thousands)


class History:
    """A request's prompt + output as a growing int32 array (Request.spec_suffix); synced
    from the request's lists each proposal, appending only the new tokens."""

    def __init__(self):
        self.buf = np.empty(256, np.int32)  # [capacity]
        self.n = 0

    def sync(self, prompt: Sequence[int], output: Sequence[int]) -> np.ndarray:  # [n] the tokens so far
        total = len(prompt) + len(output)
        if total < self.n:  # cut (never while it runs): index again
            self.n = 0
        if total > self.n:
            new = list(prompt[self.n:]) + list(output[max(0, self.n - len(prompt)):]) if self.n < len(prompt) \
                else output[self.n - len(prompt):]
            if total > len(self.buf):
                grown = np.empty(max(total, 2 * len(self.buf)), np.int32)
                grown[:self.n] = self.buf[:self.n]
                self.buf = grown
            self.buf[self.n:total] = new
            self.n = total
        return self.buf[:self.n]


class GlobalCache:
    """Recent requests' outputs, oldest first, SEP after each; at most `max_tokens` tokens
    (SEPs included), evicting whole requests from the oldest end."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.parts: collections.deque = collections.deque()  # int32 arrays, each ending in SEP
        self.size = 0
        self._flat: np.ndarray | None = np.empty(0, np.int32)

    def add(self, output: Sequence[int]) -> None:
        if self.max_tokens < 2 or not len(output):
            return
        part = np.empty(min(len(output), self.max_tokens - 1) + 1, np.int32)
        part[:-1] = output[len(output) - (len(part) - 1):]  # an over-long output keeps its end
        part[-1] = SEP
        self.parts.append(part)
        self.size += len(part)
        while self.size > self.max_tokens:
            self.size -= len(self.parts.popleft())
        self._flat = None

    @property
    def flat(self) -> np.ndarray:  # [size] every cached output, concatenated once per change
        if self._flat is None:
            self._flat = np.concatenate(self.parts) if self.parts else np.empty(0, np.int32)
        return self._flat


def match_lengths(hay: np.ndarray,  # [N] history
                  ends: np.ndarray,  # [C] positions e with hay[e] == pattern[-1]
                  pattern: np.ndarray,  # [P] the request's newest tokens
                  ) -> np.ndarray:  # [C] length of the common suffix of hay[:e + 1] and pattern
    lengths = np.ones(len(ends), np.int64)
    alive = np.arange(len(ends))
    for j in range(1, len(pattern)):
        pos = ends[alive] - j
        ok = pos >= 0
        ok[ok] = hay[pos[ok]] == pattern[-1 - j]
        alive = alive[ok]
        if not alive.size:
            break
        lengths[alive] += 1
    return lengths


def grow(hay: np.ndarray,  # [N] history
         limit: int,  # continuations stop before hay[limit]
         ends: np.ndarray,  # [C] matched occurrences' last positions, most recent first
         cap: int, min_prob: float) -> tuple[list[int], float]:
    """The most frequent continuation of the occurrences, token by token, while the product
    of the chosen tokens' shares stays >= min_prob; (tokens, sum of those products). Ties go
    to the token seen most recently. Occurrences whose continuation ends drop out of the vote."""
    path: list[int] = []
    score, prob = 0.0, 1.0
    pos = ends + 1
    for _ in range(cap):
        pos = pos[pos < limit]
        toks = hay[pos]
        keep = toks != SEP
        pos, toks = pos[keep], toks[keep]
        if not toks.size:
            break
        if toks.size == 1 or (toks == toks[0]).all():
            tok, share = int(toks[0]), 1.0
        else:
            vals, first, counts = np.unique(toks, return_index=True, return_counts=True)
            i = np.lexsort((first, -counts))[0]  # most votes, then the most recent
            tok, share = int(vals[i]), counts[i] / toks.size
        prob *= share
        if prob < min_prob:
            break
        path.append(tok)
        score += prob
        pos = pos[toks == tok] + 1
    return path, score


def propose_from(hay: np.ndarray,  # [N] history
                 limit: int, ends: np.ndarray,  # [C] candidate places of the newest token, most recent first
                 pattern: np.ndarray,  # [P] the newest tokens
                 k: int, spec_factor: float, min_prob: float) -> tuple[list[int], float, int]:
    """The best-scoring proposal over the match lengths found in one history: (tokens,
    score, match length); of equal scores the longest match's."""
    if not ends.size:
        return [], 0.0, 0
    lengths = match_lengths(hay, ends, pattern)
    best: tuple[list[int], float, int] = ([], 0.0, 0)
    for level in np.unique(lengths)[::-1][:MAX_LEVELS]:
        cap = min(k, int(spec_factor * level))
        if cap <= best[1]:  # no proposal this short can score higher (each token adds <= 1)
            break
        path, score = grow(hay, limit, ends[lengths >= level][:MAX_VOTERS], cap, min_prob)
        if score > best[1]:
            best = (path, score, int(level))
    return best


class SuffixProposer:
    """One scheduler's proposer; `settings` is the config's SpeculativeSettings."""

    def __init__(self, settings):
        self.max_depth = settings.suffix_max_depth
        self.spec_factor = settings.suffix_spec_factor
        self.min_prob = settings.suffix_min_token_prob
        self.cache = GlobalCache(settings.suffix_cache_tokens)

    def propose(self, history: History, prompt: Sequence[int], output: Sequence[int], k: int) -> list[int]:
        """Up to k tokens to follow prompt + output ([] when nothing matches well enough)."""
        toks = history.sync(prompt, output)
        n = len(toks)
        if k <= 0 or n < 1:
            return []
        pattern = toks[max(0, n - self.max_depth):]
        last = toks[-1]
        local = propose_from(toks, n, np.flatnonzero(toks[:n - 1] == last)[::-1], pattern, k, self.spec_factor,
                             self.min_prob)
        flat = self.cache.flat
        shared = propose_from(flat, len(flat), np.flatnonzero(flat == last)[::-1], pattern, k, self.spec_factor,
                              self.min_prob) if flat.size else ([], 0.0, 0)
        # equal scores (both sure of num_tokens tokens, say): the longer match knows more context
        return (shared if shared[1:] > local[1:] else local)[0]

    def finished(self, output: Sequence[int]) -> None:
        """A request ended: its output joins the global cache."""
        self.cache.add(output)
