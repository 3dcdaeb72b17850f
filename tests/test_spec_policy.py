"""When speculation proposes (engine/speculative/policy.py): the batch-size switch and the
per-request backoff turn proposals off and on mid-request, and the output never changes.

The engine tests drive the tiny random model with NaN-filled unused pages (as
tests/test_spec_ngram.py does) and watch the scheduler's plans: which steps carried
proposals, for which request. The backoff test swaps the n-gram proposer for one that is
always wrong (every proposal rejected) beside one that is always right (the reference's
own next tokens), so the expected on/off pattern is exact.
"""

from types import SimpleNamespace

import pytest

from jaxfill.engine.config import SpeculativeSettings, load_config
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
from jaxfill.engine.speculative.policy import SpecPolicy
from jaxfill.models.config import ConfigError
from fast_engine import REFERENCE_ATTENTION
from test_spec_ngram import SPEC

OVERRIDES = {**REFERENCE_ATTENTION,  # tests/fast_engine.py; one token bucket
             "engine.max_num_batched_tokens": 32, "engine.token_buckets": [32], "engine.num_pages": 64,
             "engine.max_model_len": 128, "engine.max_num_seqs": 4, "engine.page_size": 8,
             "engine.kv_fill_value": float("nan")}


@pytest.fixture(scope="module")
def model():
    from jaxfill.engine.loading import build_model

    return build_model(load_config("tiny_random", OVERRIDES), progress=False)


def make_engine(model, **extra) -> Engine:
    return Engine(load_config("tiny_random", {**OVERRIDES, **extra}), progress=False, model=model)


def watch_plans(eng: Engine) -> list[tuple[int, dict[str, int]]]:
    """Each planned step with decodes: (its running decode count, {request id: proposals})."""
    sched = eng.scheduler.replicas[0]
    plans, seen = [], {}
    proposing, schedule = sched.proposing, sched._schedule

    def spy_proposing(num_decodes):
        seen["n"] = num_decodes
        return proposing(num_decodes)

    def spy_schedule():
        out = schedule()
        if "n" in seen:
            plans.append((seen.pop("n"), {s.req.request_id: len(s.draft) for s in out.seqs}))
        return out

    sched.proposing, sched._schedule = spy_proposing, spy_schedule
    return plans


def run(eng: Engine, reqs, overlapped: list | None = None) -> list[list[int]]:
    """Each request's tokens; `overlapped` gets, per step, whether a step was left in flight."""
    for i, (prompt, sp) in enumerate(reqs):
        eng.add_request(prompt, sp, request_id=f"r{i}")
    got = {f"r{i}": [] for i in range(len(reqs))}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += list(o.new_token_ids)
        if overlapped is not None:
            overlapped.append(eng.core._in_flight is not None)
    st = eng.stats()
    assert st["pages_free"] == st["pages_total"]
    return [got[f"r{i}"] for i in range(len(reqs))]


def test_config_refuses_bad_policy_values_by_name():
    for key, value in (("disable_by_batch_size", -1), ("disable_by_batch_size", 1), ("backoff_window", 2.5),
                       ("backoff_min_acceptance", 1.5), ("backoff_steps", 0), ("backoff_max_steps", 4)):
        with pytest.raises(ConfigError, match=f"speculative.{key}") as e:
            load_config("tiny_random", {**SPEC, f"speculative.{key}": value})
        assert "\n" not in str(e.value)
    load_config("tiny_random", {**SPEC, "speculative.backoff_window": 0, "speculative.backoff_steps": 0})


def test_backoff_doubles_and_resets_after_a_window_that_pays():
    policy = SpecPolicy(SpeculativeSettings(method="ngram", backoff_window=2, backoff_min_acceptance=0.5,
                                            backoff_steps=2, backoff_max_steps=4))
    req = SimpleNamespace(spec_backoff=None)
    pattern = []
    for _ in range(16):
        if policy.may_propose(req):
            pattern.append(1)
            policy.record(req, 3, 0)  # every proposal rejected
        else:
            pattern.append(0)
    assert pattern == [1, 1, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0]  # 2 steps, then 4, capped at 4
    assert policy.counters.stats() == {"spec_disabled_steps": 0, "spec_backoffs": 3, "spec_backoff_requests": 1,
                                       "spec_backoff_skipped_decodes": 10}
    while not policy.may_propose(req):
        pass
    policy.record(req, 3, 3)
    policy.record(req, 3, 1)  # 4 of 6 accepted: this window pays, the next backoff is short again
    assert req.spec_backoff.next_skip == 2 and req.spec_backoff.skip == 0
    # the engine takes the step in flight first only when some running request may propose
    resting = SimpleNamespace(spec_backoff=SimpleNamespace(skip=3))
    assert policy.would_propose([req, resting]) and not policy.would_propose([resting])
    limited = SpecPolicy(SpeculativeSettings(method="ngram", disable_by_batch_size=2))
    assert limited.would_propose([req]) and not limited.would_propose([req, req])


def test_batch_size_switch_keeps_proposals_out_of_big_steps_and_the_output(model):
    pat = [17, 4, 99, 23, 8, 61, 5]
    reqs = [(pat * 5, SamplingParams(max_tokens=m)) for m in (24, 18, 12)]
    reqs.append((pat * 4 + [3], SamplingParams(max_tokens=20, temperature=0.8, seed=4)))
    ref = run(make_engine(model), reqs)
    eng = make_engine(model, **SPEC, **{"speculative.disable_by_batch_size": 3, "speculative.backoff_window": 0})
    plans, overlapped = watch_plans(eng), []
    assert run(eng, reqs, overlapped) == ref
    assert any(overlapped)  # steps without proposals overlap again (async scheduling), output unchanged
    big = [drafts for n, drafts in plans if n >= 3]
    small = [drafts for n, drafts in plans if n < 3]
    assert big and small
    assert not any(any(d.values()) for d in big)  # at or over the threshold: no verification rows
    assert any(any(d.values()) for d in small)  # below it the requests still running propose again
    st = eng.stats()
    assert st["spec_disabled_steps"] == len(big) and st["spec_accepted_tokens"] > 0


def test_backoff_stops_a_rejected_request_and_not_an_accepted_one(model, monkeypatch):
    from jaxfill.engine.scheduler import verification

    good_prompt, bad_prompt = [40, 41, 42, 43] * 4, [7, 9, 11, 13, 15] * 3
    reqs = [(good_prompt, SamplingParams(max_tokens=30)),
            (bad_prompt, SamplingParams(max_tokens=24, temperature=0.9, top_k=30, seed=2))]
    ref = run(make_engine(model), reqs)
    bad = next(t for t in range(300) if t not in ref[1])  # never emitted: every proposal of it is rejected

    def proposer(tokens, k, ngram_max, ngram_min):  # [n] prompt + output -> [k]
        if tokens[:len(good_prompt)] == good_prompt:  # the reference's next tokens: always accepted
            done = len(tokens) - len(good_prompt)
            return ref[0][done:done + k]
        return [bad] * k

    monkeypatch.setattr(verification, "propose_ngram", proposer)
    eng = make_engine(model, **SPEC, **{"speculative.backoff_window": 2, "speculative.backoff_steps": 3,
                                        "speculative.backoff_max_steps": 6})
    plans = watch_plans(eng)
    assert run(eng, reqs) == ref  # greedy and seeded outputs unchanged while proposals go off and on
    good = [d["r0"] for _, d in plans if "r0" in d]
    rejected = [bool(d["r1"]) for _, d in plans if "r1" in d]
    assert all(good[:-1])  # always accepted: proposes at every decode (but the last, with no room left)
    # window 2 of rejections -> 3 steps off, back on for a window -> 6 steps off (doubled) -> on again
    assert rejected[:14] == [True, True] + [False] * 3 + [True, True] + [False] * 6 + [True], rejected
    st = eng.stats()
    assert st["spec_backoff_requests"] == 1 and st["spec_backoffs"] >= 2
    assert st["spec_backoff_skipped_decodes"] >= 9 and st["spec_disabled_steps"] == 0
