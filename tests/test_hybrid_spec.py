"""Speculative decoding on linear-attention hybrids (engine/scheduler/verification.py): a
verification advances the recurrent state over every proposal, so after a rejection the
state goes back to the copy taken before the step and the accepted rows are replayed.

Greedy output with n-gram / suffix proposals equals output without, token for token, for a
Gated DeltaNet hybrid (Qwen3.5) and a Mamba2 hybrid (Granite 4.0-H), on self-repeating
prompts (proposals from the first decode) with chunked prefill, async scheduling and state
snapshots (prefix caching); the counters show proposals both accepted and rejected (so a
state that kept a rejected row would change the tokens: the check can fail). Every page
and state slot comes back after finishing and after aborts mid-decode. Unused pages and
slots are NaN-filled.
"""

import numpy as np
import pytest

from hf_models import make_hf_checkpoint
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
from fast_engine import REFERENCE_ATTENTION

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
BASE = {**REFERENCE_ATTENTION,  # tests/fast_engine.py
        "engine.max_num_batched_tokens": 16, "engine.token_buckets": [16], "engine.num_pages": 64,
        "engine.page_size": 8, "engine.max_model_len": 128, "engine.max_num_seqs": 3,
        "engine.kv_fill_value": float("nan"), "engine.state_snapshot_tokens": 16,
        "engine.async_scheduling": True}
NGRAM = {"speculative.method": "ngram", "speculative.num_tokens": 3, "speculative.ngram_max": 3,
         "speculative.ngram_min": 1, "speculative.backoff_window": 0}


@pytest.fixture(scope="module", params=["qwen3_5", "granitemoehybrid"])
def checkpoint(request, tmp_path_factory):
    directory = make_hf_checkpoint(str(tmp_path_factory.mktemp("hybrid_spec") / request.param), request.param)
    return directory


def engine(directory, **overrides) -> Engine:
    return Engine.from_config("tiny", model_path=directory, overrides={**BASE, **overrides}, progress=False)


def prompts(vocab: int) -> list[list[int]]:
    """Self-repeating prompts (the n-gram proposer finds matches at once), one past a state
    snapshot boundary and the chunk size, and two sharing their first 16 tokens (a snapshot hit)."""
    rng = np.random.default_rng(5)
    pat = [int(t) for t in rng.integers(0, vocab, 5)]
    other = [int(t) for t in rng.integers(0, vocab, 4)]
    return [pat * 7, pat * 4 + other * 2, pat * 4 + [pat[0]] * 3, other * 5]


def all_back(e: Engine) -> None:
    st = e.stats()
    sch = e.scheduler.replicas[0]
    assert st["pages_free"] == st["pages_total"] and not e.has_unfinished()
    assert sorted(sch.free_slots) == list(range(e.config.engine.state_slots))
    sch.bm.check()


def test_greedy_with_ngram_equals_without(checkpoint):
    plain = engine(checkpoint)
    ps = prompts(plain.config.model.vocab_size)
    want = [o.token_ids for o in plain.generate(ps, GREEDY)]
    spec = engine(checkpoint, **NGRAM)
    assert spec.config.engine.state_slots == 2 * plain.config.engine.state_slots  # a second slot each
    got = [o.token_ids for o in spec.generate(ps, GREEDY)]
    st = spec.stats()
    assert st["spec_accepted_tokens"] > 0 and st["spec_state_replays"] > 0, st  # accepted and rejected
    assert st["spec_proposed_tokens"] > st["spec_accepted_tokens"]
    assert got == want
    all_back(spec)
    # a second round: prompts resume from state snapshots (prefix caching) and still agree
    hits = st.get("state_snapshot_hits", 0)
    assert [o.token_ids for o in spec.generate(ps, GREEDY)] == want
    assert spec.stats().get("state_snapshot_hits", 0) > hits
    all_back(spec)


def test_suffix_proposals_and_aborts_give_every_slot_back(checkpoint):
    plain = engine(checkpoint)
    ps = prompts(plain.config.model.vocab_size)
    want = [o.token_ids for o in plain.generate(ps[:2], GREEDY)]
    spec = engine(checkpoint, **{**NGRAM, "speculative.method": "suffix", "engine.async_scheduling": False})
    assert [o.token_ids for o in spec.generate(ps[:2], GREEDY)] == want
    assert spec.stats()["spec_accepted_tokens"] > 0
    ids = [spec.add_request(p, GREEDY) for p in ps]
    for _ in range(12):  # into the decodes, some verifying
        spec.step()
    assert spec.stats()["spec_verifications"] > 0
    for i in ids:
        spec.abort(i)
    while spec.has_unfinished():
        spec.step()
    all_back(spec)
