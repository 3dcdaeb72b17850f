"""Speculative decoding with n-gram proposals (engine/speculative/): invisible in the output.

Greedy and seeded-sampled outputs with speculation equal those without, token for token
(logprobs within f32 noise), with stops, penalties and lengths mixed in, chunked prefill
and prefix-cache hits; proposals are actually accepted (the stats say so, so the check
can fail); every page comes back and the prefix cache holds accepted tokens only.
Unused KV pages are NaN-filled: a step that reads a rejected row it should not poisons it.
"""

import numpy as np
import pytest

from jaxfill.engine.block_manager import prefix_hashes
from jaxfill.engine.config import load_config
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
from jaxfill.engine.speculative.acceptance import SpecCounters, accept_prefix
from jaxfill.engine.speculative.ngram import propose_ngram
from jaxfill.models.config import ConfigError
from fast_engine import REFERENCE_ATTENTION

OVERRIDES = {**REFERENCE_ATTENTION,  # tests/fast_engine.py
             "engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64], "engine.num_pages": 64,
             "engine.max_model_len": 256, "engine.max_num_seqs": 4, "engine.page_size": 8}
SPEC = {"speculative.method": "ngram", "speculative.num_tokens": 3, "speculative.ngram_max": 3,
        "speculative.ngram_min": 1}


@pytest.fixture(scope="module")
def model():
    from jaxfill.engine.loading import build_model

    return build_model(load_config("tiny_random", OVERRIDES), progress=False)


def make_engine(model, **extra) -> Engine:
    cfg = load_config("tiny_random", {**OVERRIDES, **extra, "engine.kv_fill_value": float("nan")})
    return Engine(cfg, progress=False, model=model)


def requests():
    """Self-repeating prompts (proposals exist from the first decode) and a random one."""
    rng = np.random.default_rng(3)
    pat = rng.integers(0, 256, 7).tolist()
    return [
        (pat * 6, SamplingParams(max_tokens=20, logprobs=2)),
        (pat * 3 + [9, 9], SamplingParams(max_tokens=17, temperature=0.9, top_k=20, seed=11, logprobs=1)),
        (rng.integers(0, 256, 30).tolist(), SamplingParams(max_tokens=12, repetition_penalty=1.3,
                                                           presence_penalty=0.5, seed=5, temperature=0.7)),
        (pat * 4, SamplingParams(max_tokens=9, min_tokens=4)),
    ]


def generate(eng: Engine, reqs):
    prompts = [p for p, _ in reqs]
    return eng.generate(prompts, [sp for _, sp in reqs])


def assert_same(a, b):
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert x.finish_reason == y.finish_reason
        if x.logprobs:
            for lx, ly in zip(x.logprobs, y.logprobs):
                assert lx["token_id"] == ly["token_id"]
                assert abs(lx["logprob"] - ly["logprob"]) < 1e-4
                assert [i for i, _ in lx["top"]] == [i for i, _ in ly["top"]]


def assert_clean(eng: Engine):
    st = eng.stats()
    assert st["pages_free"] == st["pages_total"]
    assert not eng.has_unfinished()
    for sched in eng.scheduler.replicas:
        sched.bm.check()


def accepted_only(eng: Engine, outs, reqs) -> None:
    """Every page hash in the prefix cache names a page of some request's prompt + emitted tokens."""
    ps = eng.settings.page_size
    allowed = set()
    for (prompt, sp), c in zip(reqs, outs):
        allowed |= set(prefix_hashes(prompt + c.token_ids, ps, sp.cache_salt))
    for sched in eng.scheduler.replicas:
        assert set(sched.bm.cached) <= allowed


@pytest.fixture(scope="module")
def reference(model):
    eng = make_engine(model)
    out = generate(eng, requests())
    assert "spec_proposed_tokens" not in eng.stats()  # off by default
    return out


def test_proposer_finds_the_most_recent_match_with_a_full_continuation():
    toks = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
    assert propose_ngram(toks, 2, 3, 1) == [3, 5]  # "1 2" last followed by 3 5
    assert propose_ngram(toks, 3, 3, 2) == [3, 5, 1]
    assert propose_ngram([7, 8, 9], 3, 3, 1) == []
    assert propose_ngram([5, 5, 5, 5], 3, 2, 1) == [5, 5]  # only two tokens follow the earlier "5 5"
    assert propose_ngram([1, 2, 1, 2], 0, 2, 1) == []


def test_accept_prefix_stops_at_the_first_mismatch_and_adds_the_bonus():
    assert accept_prefix([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert accept_prefix([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert accept_prefix([4], [3, 8]) == [3]
    assert accept_prefix([], [2]) == [2]
    c = SpecCounters(3)
    c.record(3, 2)
    c.record(1, 0)
    assert c.stats()["spec_accepted_per_position"] == [1, 1, 0]
    assert c.stats()["spec_mean_acceptance_length"] == 2.0


def test_config_refuses_unknown_and_later_methods_by_name():
    for method in ("mtp", "eagle3", "lookahead"):
        with pytest.raises(ConfigError, match="speculative.method") as e:
            load_config("tiny_random", {"speculative.method": method})
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="speculative.method = none"):
        load_config("tiny_random", {"speculative.method": "ngram", "mesh.data": 2})
    hybrid = load_config("qwen3_5_9b", {"speculative.method": "ngram"})  # tests/test_hybrid_spec.py
    assert hybrid.engine.state_slots == 2 * hybrid.engine.max_num_seqs  # a second slot per request


def test_speculation_is_invisible_in_greedy_and_seeded_outputs(model, reference):
    eng = make_engine(model, **SPEC)
    reqs = requests()
    out = generate(eng, reqs)
    assert_same(reference, out)
    st = eng.stats()
    assert st["spec_accepted_tokens"] > 0, st  # proposals were verified and accepted
    assert st["spec_accepted_tokens"] < st["spec_proposed_tokens"], st  # and some rejected (rolled back)
    assert len(st["spec_accepted_per_position"]) == 3
    assert st["spec_mean_acceptance_length"] > 1.0
    assert_clean(eng)
    accepted_only(eng, out, reqs)
    # the prefix cache now holds those prompts: a second run hits it and still matches
    again = generate(eng, reqs)
    assert_same(reference, again)
    assert any(c.cached_tokens for c in again)
    assert_clean(eng)
    accepted_only(eng, out, reqs)


def test_chunked_prefill_and_a_tight_budget_keep_the_output(model, reference):
    # 16-token steps: proposals shrink to what the decodes leave; prompts arrive in chunks of 8
    eng = make_engine(model, **SPEC, **{"engine.max_num_batched_tokens": 16, "engine.token_buckets": [16],
                                        "engine.long_prefill_token_threshold": 8,
                                        "engine.enable_prefix_caching": False})
    out = generate(eng, requests())
    assert_same(reference, out)
    assert eng.stats()["spec_accepted_tokens"] > 0
    assert_clean(eng)


def test_stop_ids_and_max_tokens_inside_an_accepted_run_cut_exactly(model):
    prompt = [3, 1, 4, 1, 5] * 8
    first = make_engine(model).generate([prompt], SamplingParams(max_tokens=30))[0]
    stop = first.token_ids[5]  # a token the run emits: it must end the output where one step at a time would
    text_stop = first.text[len(first.text) // 2:][:2]  # and a stop string from the middle of its text
    cases = [SamplingParams(max_tokens=30, stop_token_ids=[stop]), SamplingParams(max_tokens=6),
             SamplingParams(max_tokens=30, stop=[text_stop])]
    ref = make_engine(model).generate([prompt] * 3, cases)
    eng = make_engine(model, **SPEC)
    out = eng.generate([prompt] * 3, cases)
    assert_same(ref, out)
    assert [c.text for c in out] == [c.text for c in ref]
    assert out[0].token_ids[-1] == stop and len(out[1].token_ids) == 6
    assert text_stop and out[2].finish_reason == "stop" and len(out[2].token_ids) < 30
    assert eng.stats()["spec_accepted_tokens"] > 0
    assert_clean(eng)


def test_prometheus_counts_the_stats_growth_under_vllms_names():
    from jaxfill.serving.metrics import ServerMetrics

    m = ServerMetrics(model_name="tiny")
    m.update_stats({"spec_verifications": 2, "spec_proposed_tokens": 6, "spec_accepted_tokens": 3})
    m.update_stats({"spec_verifications": 5, "spec_proposed_tokens": 15, "spec_accepted_tokens": 9})
    text = m.render().decode()
    assert 'jaxfill_spec_decode_num_drafts_total{model_name="tiny"} 3.0' in text
    assert 'jaxfill_spec_decode_num_draft_tokens_total{model_name="tiny"} 9.0' in text
    assert 'jaxfill_spec_decode_num_accepted_tokens_total{model_name="tiny"} 6.0' in text


@pytest.mark.slow
def test_prompt_logprobs_rows_and_verification_rows_share_a_step(model):
    # the long prompt's scored chunks run while the short one decodes with proposals
    reqs = [([2, 7, 1, 8] * 4, SamplingParams(max_tokens=14)),
            (list(range(40, 100)), SamplingParams(max_tokens=4, prompt_logprobs=1))]
    extra = {"engine.long_prefill_token_threshold": 8}
    ref = generate(make_engine(model, **extra), reqs)
    eng = make_engine(model, **SPEC, **extra)
    both, run = [], eng.runner.run

    def spy(batch):
        both.append(batch.verify is not None and bool((np.asarray(batch.lp_rows) >= 0).any()))
        return run(batch)

    eng.runner.run = spy
    out = generate(eng, reqs)
    assert any(both)  # a step verified proposals and scored prompt rows
    assert_same(ref, out)
    for a, b in zip(ref[1].prompt_logprobs[1:], out[1].prompt_logprobs[1:]):
        assert a["token_id"] == b["token_id"] and abs(a["logprob"] - b["logprob"]) < 1e-4
    assert eng.stats()["spec_accepted_tokens"] > 0
    assert_clean(eng)


def test_proposals_are_cut_to_room_max_tokens_and_max_model_len_and_skip_grammars():
    from types import SimpleNamespace

    from jaxfill.engine.config import SpeculativeSettings
    from jaxfill.engine.scheduler import Scheduler

    cfg = load_config("tiny_random", {**OVERRIDES, "engine.max_model_len": 40})
    sched = Scheduler(cfg.engine, speculative=SpeculativeSettings(method="ngram", num_tokens=4, ngram_min=1))

    def req(out, max_tokens=100, matcher=None, in_flight=0):
        prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 3
        return SimpleNamespace(prompt_ids=prompt, output_ids=out, matcher=matcher, in_flight=in_flight, spec_backoff=None,
                               num_tokens=len(prompt) + len(out), params=SamplingParams(max_tokens=max_tokens))

    assert sched.draft_for(req([1, 2]), room=10) == [3, 4, 5, 6]
    assert sched.draft_for(req([1, 2]), room=2) == [3, 4]  # the step's budget
    assert sched.draft_for(req([1, 2], max_tokens=4), room=10) == [3]  # 2 emitted + 1 proposal + 1 bonus = 4
    assert sched.draft_for(req([1, 2] + [9] * 12), room=10) == [9, 9]  # 38 tokens of max_model_len 40
    assert sched.draft_for(req([1, 2], matcher=object()), room=10) == []  # structured output: no proposals
    assert sched.draft_for(req([1, 2], in_flight=1), room=10) == []
    assert Scheduler(cfg.engine).draft_for(req([1, 2]), room=10) == []  # speculative off


def test_rejected_rows_pages_go_back_after_every_step(model):
    """After each step a running request holds the pages of its computed rows, no more:
    pages taken for proposals that were rejected are back in the pool at once."""
    eng = make_engine(model, **SPEC)
    for i, (prompt, sp) in enumerate(requests()):
        eng.add_request(prompt, sp, request_id=str(i))
    page = eng.settings.page_size
    while eng.has_unfinished():
        eng.step()
        for sched in eng.scheduler.replicas:
            for req in sched.running:
                if req.output_ids:
                    assert len(req.pages) == -(-req.num_computed // page), req.request_id
    st = eng.stats()
    assert 0 < st["spec_accepted_tokens"] < st["spec_proposed_tokens"]
    assert_clean(eng)


def test_n_samples_keep_their_seeded_outputs(model):
    prompt = [4, 4, 2, 9, 4, 4, 2, 9, 4, 4, 2]
    sp = SamplingParams(n=3, max_tokens=16, temperature=0.05, seed=7)  # sampled, yet repetitive enough
    ref = make_engine(model).generate([prompt], sp)
    eng = make_engine(model, **SPEC)
    out = eng.generate([prompt], sp)
    assert sorted((c.index, c.token_ids) for c in out) == sorted((c.index, c.token_ids) for c in ref)
    assert eng.stats()["spec_accepted_tokens"] > 0
    assert_clean(eng)
