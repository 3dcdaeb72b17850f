"""engine.async_scheduling: step N+1 is dispatched before step N's tokens reach the host.

Async on must give exactly the tokens, text, logprobs and finish reasons of async off,
with every kind of stop, aborts, preemption, chunked prefill and penalties mixed in; every
page comes back; a request stopped by a token never shows the extra token computed for it.
Unused KV pages are NaN-filled, so a step that reads a page nobody wrote poisons its logits.
"""

import numpy as np
import pytest

from jaxfill.engine.config import load_config
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
from fast_engine import REFERENCE_ATTENTION

OVERRIDES = {**REFERENCE_ATTENTION,  # tests/fast_engine.py
             "engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64], "engine.num_pages": 64,
             "engine.max_model_len": 256, "engine.max_num_seqs": 8}
SMALL_POOL = {"engine.num_pages": 14, "engine.long_prefill_token_threshold": 24}  # preempts, chunks


@pytest.fixture(scope="module")
def model():
    from jaxfill.engine.loading import build_model

    return build_model(load_config("tiny_random", OVERRIDES), progress=False)


def make_engine(model, async_on: bool, defer_text: bool = False, **extra) -> Engine:
    cfg = load_config("tiny_random", {**OVERRIDES, **extra, "engine.async_scheduling": async_on,
                                      "engine.kv_fill_value": float("nan")})  # unwritten pages poison logits
    return Engine(cfg, progress=False, model=model, defer_text=defer_text)


def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(0, 256, n).tolist() for n in (90, 3, 25, 9, 130, 1, 17, 33, 60, 12)]


def drive(eng: Engine, requests, abort_after: dict[str, int] = {}):
    """Adds every (id, prompt, params), steps to the end; aborts request r once it has
    streamed abort_after[r] tokens. Returns {id: (streamed ids, streamed text, Completion)}."""
    streamed = {rid: ([], []) for rid, _, _ in requests}
    done = {}
    for rid, prompt, params in requests:
        eng.add_request(prompt, params, request_id=rid)
    for _ in range(2000):
        if not eng.has_unfinished():
            break
        for o in eng.step():
            ids, text = streamed[o.request_id]
            ids += o.new_token_ids
            text.append(o.new_text)
            if o.finished:
                done[o.request_id] = o.completion
            elif len(ids) >= abort_after.get(o.request_id, 1 << 30):
                eng.abort(o.request_id)
    return {rid: (ids, "".join(text), done[rid]) for rid, (ids, text) in streamed.items()}


def assert_clean(eng: Engine):
    st = eng.stats()
    assert st["pages_free"] == st["pages_total"]
    assert not eng.requests and not eng.has_unfinished()
    for sched in eng.scheduler.replicas:
        sched.bm.check()
    assert all(r.in_flight == 0 for s in eng.scheduler.replicas for r in s.waiting + s.running)


def assert_same_logprobs(a, b):
    """Same tokens and top ids; values within the ~1e-6 f32 noise between batch shapes."""
    assert (a is None) == (b is None)
    for x, y in zip(a or [], b or [], strict=True):
        assert x["token_id"] == y["token_id"] and [i for i, _ in x["top"]] == [i for i, _ in y["top"]]
        np.testing.assert_allclose([x["logprob"]] + [v for _, v in x["top"]],
                                   [y["logprob"]] + [v for _, v in y["top"]], rtol=1e-5, atol=1e-5)


def stop_index(ids: list[int], at: int) -> int:
    """The first index >= at whose token does not occur before it: stopping on that token
    ends the stream there, mid-decode."""
    return next(i for i in range(at, len(ids)) if ids[i] not in ids[:i])


def seeded(i: int, **kw) -> SamplingParams:
    """Prompt i's sampling in the reference run: seeded draws vary more than greedy ones on
    a random model, so a token taken from the wrong row would show."""
    return SamplingParams(**{"max_tokens": 14, "temperature": 1.0, "seed": 100 + i, "ignore_eos": True, **kw})


def mixed_requests(reference):
    """Stops chosen from what the reference run produced, so each one really fires."""
    ps = prompts()
    ref = {rid: c.token_ids for rid, (_, _, c) in reference.items()}
    ref_text = {rid: c.text for rid, (_, _, c) in reference.items()}
    return [
        ("greedy", ps[1], SamplingParams(max_tokens=14, ignore_eos=True)),
        ("seeded", ps[0], seeded(0, top_k=40)),
        ("stop_id", ps[2], seeded(2, stop_token_ids=(ref["s2"][stop_index(ref["s2"], 4)],))),
        ("stop_str", ps[3], seeded(3, stop=(ref_text["s3"][5:7],))),
        ("eos", ps[4], seeded(4, ignore_eos=False)),  # the engine's eos id is one of s4's tokens
        ("penalties", ps[6], seeded(6, repetition_penalty=1.4, frequency_penalty=0.5, logprobs=3)),
        ("greedy_penalties", ps[5], SamplingParams(max_tokens=12, presence_penalty=1.0, ignore_eos=True)),
        ("aborted", ps[7], seeded(7)),
        ("max_tokens_1", ps[8], seeded(8, max_tokens=1)),
        ("long", ps[9], seeded(9, max_tokens=20, logprobs=2)),
    ]


@pytest.fixture(scope="module")
def reference(model):
    """Seeded outputs (async off, big pool) of every prompt, named s0..s9."""
    eng = make_engine(model, False)
    return drive(eng, [(f"s{i}", p, seeded(i)) for i, p in enumerate(prompts())])


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["big", "small"])
def test_async_on_and_off_give_the_same_outputs(model, reference, pool):
    s4 = reference["s4"][2].token_ids
    extra = {"model.eos_token_id": [s4[stop_index(s4, 3)]]}
    if pool == "small":
        extra.update(SMALL_POOL)
    requests = mixed_requests(reference)
    results, engines = {}, {}
    for async_on in (False, True):
        eng = make_engine(model, async_on, **extra)
        programs = eng.stats()["compiled_programs"]
        results[async_on] = drive(eng, requests, abort_after={"aborted": 3})
        assert_clean(eng)
        assert eng.stats()["compiled_programs"] == programs  # no step compiled after warm-up
        engines[async_on] = eng
    sync, asyn = results[False], results[True]
    for rid, _, _ in requests:
        (ids0, text0, c0), (ids1, text1, c1) = sync[rid], asyn[rid]
        assert ids1 == ids0 == c0.token_ids == c1.token_ids, rid
        assert text1 == text0 == c0.text == c1.text, rid
        assert c1.finish_reason == c0.finish_reason, rid
        assert_same_logprobs(c1.logprobs, c0.logprobs)
    # Each stop really fired, as the plain run predicts.
    s2 = reference["s2"][2].token_ids
    assert sync["stop_id"][2].finish_reason == "stop" and sync["stop_id"][0] == s2[:stop_index(s2, 4) + 1]
    assert sync["eos"][2].finish_reason == "stop" and sync["eos"][0] == s4[:stop_index(s4, 3) + 1]
    assert sync["stop_str"][2].finish_reason == "stop"
    assert sync["stop_str"][1] == reference["s3"][2].text[:5]
    assert sync["aborted"][2].finish_reason == "abort" and sync["aborted"][0] == reference["s7"][0][:3]
    assert sync["seeded"][0] != sync["greedy"][0]
    assert len(sync["max_tokens_1"][0]) == 1
    if pool == "small":
        for eng in engines.values():
            assert eng.stats()["num_preemptions"] > 0


def test_a_request_stopped_by_a_token_never_emits_the_extra_computed_token(model, reference):
    """r stops on a token: async computes one more decode for it and drops it. m ends at
    max_tokens and t at max_model_len, known in advance: nothing extra is computed. b keeps
    the engine stepping after r is done, so the dropped row is really taken."""
    ref = reference["s2"][2].token_ids
    k = stop_index(ref, 2)
    long_prompt = prompts()[0] * 3
    requests = [("r", prompts()[2], seeded(2, stop_token_ids=(ref[k],))),
                ("m", prompts()[3], seeded(3, max_tokens=5)),
                ("t", long_prompt[:250], seeded(0, max_tokens=50)),
                ("b", prompts()[4], seeded(4, max_tokens=20))]
    scheduled, got = {}, {}
    for async_on in (False, True):
        eng = make_engine(model, async_on)
        real = eng.scheduler.schedule
        count = scheduled.setdefault(async_on, {rid: 0 for rid, _, _ in requests})

        def schedule(real=real, count=count):
            scheds = real()
            for sch in (sch for sc in scheds for sch in sc.seqs):
                count[sch.req.request_id] += 1
            return scheds

        eng.scheduler.schedule = schedule
        got[async_on] = drive(eng, requests)
        ids, _, c = got[async_on]["r"]
        assert ids == c.token_ids == ref[:k + 1] and c.finish_reason == "stop"
        assert got[async_on]["t"][2].finish_reason == "length" and len(got[async_on]["t"][0]) == 6
        assert_clean(eng)
    assert {rid: x[0] for rid, x in got[True].items()} == {rid: x[0] for rid, x in got[False].items()}
    # r: prefill + k decodes; async also ran the decode after the stop token (computed, never emitted).
    assert scheduled[False]["r"] == k + 1 and scheduled[True]["r"] == k + 2
    assert scheduled[True]["m"] == scheduled[False]["m"] and scheduled[True]["t"] == scheduled[False]["t"]


@pytest.mark.slow
def test_many_requests_finishing_at_different_steps_match_the_plain_run(model, reference):
    """Many requests at once, finishing at different steps, so rows move between steps."""
    eng = make_engine(model, True, **{"engine.max_num_seqs": 4})
    got = drive(eng, [(f"s{i}", p, seeded(i, max_tokens=3 + i)) for i, p in enumerate(prompts())])
    assert {rid: ids for rid, (ids, _, _) in got.items()} == {rid: ids[:3 + int(rid[1:])]
                                                              for rid, (ids, _, _) in reference.items()}
    assert_clean(eng)
