"""Suffix decoding (speculative.method = suffix, engine/speculative/suffix.py).

The proposer on its own: repeats within a request, continuations learned from an earlier
request's output (and never across two requests' outputs), the global cache's bound, and
the number of tokens set by the match length and the vote. The engine: greedy and seeded
outputs equal speculation off token for token while proposals are accepted (the stats say
so), and a request that repeats an earlier request's output gets more accepted tokens with
suffix than with ngram (which sees only its own prompt + output).
"""

import numpy as np
import pytest

from jaxfill.engine.config import SpeculativeSettings, load_config
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
from jaxfill.engine.speculative.suffix import History, SuffixProposer
from jaxfill.models.config import ConfigError
from fast_engine import REFERENCE_ATTENTION

OVERRIDES = {**REFERENCE_ATTENTION,  # tests/fast_engine.py
             "engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64], "engine.num_pages": 64,
             "engine.max_model_len": 256, "engine.max_num_seqs": 4, "engine.page_size": 8,
             "speculative.num_tokens": 3, "speculative.disable_by_batch_size": 0, "speculative.backoff_window": 0}


def proposer(**kw) -> SuffixProposer:
    return SuffixProposer(SpeculativeSettings(method="suffix", **kw))


def propose(p: SuffixProposer, tokens, k=4):
    return p.propose(History(), tokens, [], k)


def test_repeats_within_the_request_by_match_length():
    p = proposer()
    toks = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3]
    assert propose(p, toks) == [4, 5, 6]  # a 3-token match proposes at most 3 (spec_factor 1)
    assert propose(p, toks, k=2) == [4, 5]
    assert propose(proposer(suffix_spec_factor=2.0), toks) == [4, 5, 6, 9]
    assert propose(p, [7, 8, 9, 1, 8]) == [9]  # "8" once: one token
    assert propose(p, [7, 8, 9]) == []
    # the prompt/output split and appending step by step change nothing
    h = History()
    for n in range(2, len(toks) + 1):
        assert p.propose(h, toks[:2], toks[2:n], 4) == propose(p, toks[:n])


def test_the_vote_sets_the_tokens_and_the_length():
    # "1 2" went on "3 4" twice and "3 5" once (the most recent): frequency beats recency
    toks = [1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 5, 0, 1, 2]
    assert propose(proposer(suffix_spec_factor=4.0), toks) == [3, 4, 0, 1]
    assert propose(proposer(suffix_spec_factor=4.0, suffix_min_token_prob=0.7), toks) == [3]  # 4 has 2/3
    # a tie goes to the most recent continuation
    assert propose(proposer(suffix_spec_factor=4.0), [1, 2, 3, 0, 1, 2, 4, 0, 1, 2]) == [4, 0, 1, 2]


def test_continuation_learned_from_an_earlier_requests_output():
    p = proposer()
    prompt = [50, 51, 52, 10, 11, 12]
    assert propose(p, prompt) == []
    p.finished([10, 11, 12, 13, 14, 15, 16])
    assert propose(p, prompt) == [13, 14, 15]
    assert p.propose(History(), prompt, [13, 14], 4) == [15, 16]  # never past the output's end
    # equal scores and match lengths: the request's own continuation
    assert propose(p, [10, 11, 12, 99, 98, 97, 0, 10, 11, 12]) == [99, 98, 97]
    # equal scores: the longer match (6 tokens in the cache, 3 in the request)
    p.finished([7, 8, 9, 1, 2, 3, 40, 41, 42, 43])
    toks = [1, 2, 3, 30, 31, 32, 0, 7, 8, 9, 1, 2, 3]
    assert propose(p, toks, k=3) == [40, 41, 42]
    assert propose(p, toks[3:], k=3) == [40, 41, 42] and propose(proposer(), toks, k=3) == [30, 31, 32]


def test_the_global_cache_is_bounded_and_evicts_the_oldest():
    p = proposer(suffix_cache_tokens=20)
    for r in range(5):  # 5 outputs of 7 tokens + a separator
        p.finished([100 * r + i for i in range(1, 8)])
    assert p.cache.size <= 20 and len(p.cache.flat) == p.cache.size
    assert propose(p, [9, 101, 102]) == []  # request 0 is gone
    assert propose(p, [9, 401, 402]) == [403, 404]
    p.finished(list(range(200, 240)))  # longer than the cache: its end is kept
    assert p.cache.size == 20 and propose(p, [236, 237]) == [238, 239]


def test_config_names_the_field():
    for key, value in (("suffix_max_depth", 0), ("suffix_spec_factor", 0), ("suffix_min_token_prob", 1.5),
                       ("suffix_cache_tokens", -1)):
        with pytest.raises(ConfigError, match=f"speculative.{key}"):
            load_config("tiny_random", {"speculative.method": "suffix", f"speculative.{key}": value})
    with pytest.raises(ConfigError, match="speculative.method = none"):  # the capability table covers suffix
        load_config("tiny_random", {"speculative.method": "suffix", "mesh.data": 2})


@pytest.fixture(scope="module")
def engines():
    from jaxfill.engine.loading import build_model

    model = build_model(load_config("tiny_random", OVERRIDES), progress=False)
    out = {m: Engine(load_config("tiny_random", {**OVERRIDES, "speculative.method": m,
                                                 "engine.kv_fill_value": float("nan")}), progress=False, model=model)
           for m in ("none", "suffix", "ngram")}
    yield out
    for eng in out.values():
        eng.close()


def requests():
    rng = np.random.default_rng(4)
    pat = rng.integers(0, 256, 6).tolist()
    return [(pat * 5, SamplingParams(max_tokens=18, logprobs=1)),
            (pat * 3 + [7], SamplingParams(max_tokens=15, temperature=0.9, top_k=20, seed=3)),
            (rng.integers(0, 256, 25).tolist(), SamplingParams(max_tokens=12, repetition_penalty=1.2, seed=8,
                                                               temperature=0.8))]


def run(eng: Engine, reqs):
    before = eng.stats().get("spec_accepted_tokens", 0)
    outs = eng.generate([p for p, _ in reqs], [sp for _, sp in reqs])
    return [o.token_ids for o in outs], eng.stats().get("spec_accepted_tokens", 0) - before


def test_outputs_equal_speculation_off_with_proposals_accepted(engines):
    reqs = requests()
    want, _ = run(engines["none"], reqs)
    got, accepted = run(engines["suffix"], reqs)
    assert got == want
    assert accepted > 0
    st = engines["suffix"].stats()
    assert st["pages_free"] == st["pages_total"] and not engines["suffix"].has_unfinished()


def test_a_repeated_output_is_proposed_from_the_global_cache(engines):
    """An agent loop's retry: the same request again (seeded: its output the first one's).
    ngram sees only the request's own prompt + output, where the output is new."""
    rng = np.random.default_rng(9)
    first = rng.integers(0, 256, 20).tolist()
    want, _ = run(engines["none"], [(first, SamplingParams(max_tokens=24, temperature=1.0, seed=5))])
    gains, alone = {}, {}
    for m in ("suffix", "ngram"):
        got, alone[m] = run(engines[m], [(first, SamplingParams(max_tokens=24, temperature=1.0, seed=5))])
        assert got == want
        again, gains[m] = run(engines[m], [(first, SamplingParams(max_tokens=24, temperature=1.0, seed=5))])
        assert again == want
    assert gains["suffix"] > alone["suffix"] and gains["suffix"] > gains["ngram"], (alone, gains)
    assert gains["suffix"] >= 12, gains  # most of the 24 tokens come as accepted proposals
