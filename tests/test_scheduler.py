"""Scheduler without a model: budgets, decode-first order, caps, preemption, page accounting."""

import random

import pytest

from jaxfill.engine.config import EngineSettings
from jaxfill.engine.request import Request, SamplingParams, Status
from jaxfill.engine.scheduler import Scheduler

_seq = iter(range(10**9))


def mk(n_prompt, max_tokens=4, priority=0, salt=None, tokens=None):
    ids = tokens if tokens is not None else [random.randrange(300) for _ in range(n_prompt)]
    return Request(f"r{next(_seq)}", ids, SamplingParams(max_tokens=max_tokens, cache_salt=salt),
                   priority=priority, arrival_seq=next(_seq))


def settings(**kw):
    base = dict(page_size=4, num_pages=64, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=16,
                max_num_partial_prefills=1, long_prefill_token_threshold=0)
    base.update(kw)
    return EngineSettings(**base)


def fake_step(sched: Scheduler, out, token=7):
    """A step without a model, through the scheduler's real transitions: dispatch, then
    every row's output (each sampling row draws `token`); returns the requests it finished."""
    sched.on_dispatch(out)
    done = []
    for s in out.seqs:
        sampled = sched.update_from_output(s, token, now=0.0)
        if sampled is not None and sampled.reason is not None:
            sched.finish(s.req, sampled.reason)
            done.append(s.req)
    return done


def test_decodes_first_then_chunked_prefill_fills_budget():
    sched = Scheduler(settings(max_num_batched_tokens=10))
    a = mk(3)
    sched.add(a)
    out = sched.schedule()
    assert [(s.req, s.num_new) for s in out.seqs] == [(a, 3)]
    fake_step(sched, out)
    b = mk(20)
    sched.add(b)
    out = sched.schedule()
    # a's decode (1 token) first, then 9 tokens of b's prompt: no prefill phase.
    assert [(s.req, s.start, s.num_new) for s in out.seqs] == [(a, 3, 1), (b, 0, 9)]
    assert not out.seqs[1].samples
    fake_step(sched, out)
    out = sched.schedule()
    assert [(s.req, s.start, s.num_new) for s in out.seqs] == [(a, 4, 1), (b, 9, 9)]
    fake_step(sched, out)
    out = sched.schedule()
    assert [(s.req, s.start, s.num_new) for s in out.seqs] == [(a, 5, 1), (b, 18, 2)]
    assert out.seqs[1].samples


def test_partial_prefill_cap_lets_short_prompts_pass():
    sched = Scheduler(settings(max_num_batched_tokens=32, long_prefill_token_threshold=8,
                               max_num_partial_prefills=1))
    long1, long2, short = mk(40), mk(40), mk(5)
    for r in (long1, long2, short):
        sched.add(r)
    out = sched.schedule()
    # long1 chunk capped at 8 (partial); long2 would be a second partial: skipped; short fits whole.
    assert [(s.req, s.num_new) for s in out.seqs] == [(long1, 8), (short, 5)]
    sched2 = Scheduler(settings(max_num_batched_tokens=32, long_prefill_token_threshold=8,
                                max_num_partial_prefills=2))
    for r in (mk(40), mk(40), mk(5)):
        sched2.add(r)
    assert [s.num_new for s in sched2.schedule().seqs] == [8, 8, 5]


def test_long_prefill_threshold_caps_running_chunk():
    sched = Scheduler(settings(max_num_batched_tokens=16, long_prefill_token_threshold=6))
    r = mk(30)
    sched.add(r)
    chunks = []
    while r.remaining > 1 or not r.output_ids:
        out = sched.schedule()
        chunks.append(out.seqs[0].num_new)
        fake_step(sched, out)
    assert chunks == [6, 6, 6, 6, 6]


def test_max_num_seqs_and_budget():
    sched = Scheduler(settings(max_num_seqs=3, max_num_batched_tokens=100))
    for _ in range(5):
        sched.add(mk(2))
    out = sched.schedule()
    assert len(out.seqs) == 3 and out.num_tokens == 6
    assert len(sched.waiting) == 2


def test_priority_policy_and_fcfs():
    sched = Scheduler(settings(scheduling_policy="priority", max_num_seqs=1))
    lo, hi = mk(2, priority=5), mk(2, priority=-1)
    sched.add(lo)
    sched.add(hi)
    assert sched.schedule().seqs[0].req is hi
    f = Scheduler(settings(max_num_seqs=1))
    a, b = mk(2, priority=5), mk(2, priority=-1)
    f.add(a)
    f.add(b)
    assert f.schedule().seqs[0].req is a


def test_preemption_by_recompute_when_pages_run_out():
    # 5 usable pages of 4 tokens. Two requests of 8 prompt tokens hold 2 pages each, then
    # decoding needs a third page each: the later one is preempted, never a crash.
    sched = Scheduler(settings(num_pages=6, max_num_batched_tokens=32, enable_prefix_caching=False))
    a, b = mk(8, max_tokens=8), mk(8, max_tokens=8)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [s.req.pages for s in out.seqs] == [[1, 2], [3, 4]]
    fake_step(sched, out)  # both sampled 1 token: 9 tokens, num_computed 8
    out = sched.schedule()  # a needs page 5; b needs one more: none left -> b preempted
    assert [s.req for s in out.seqs] == [a] and out.preempted == [b]
    assert b.status == Status.WAITING and b.num_computed == 0 and b.pages == []
    assert a.pages == [1, 2, 5]
    assert sched.bm.ref_counts[3] == 0 and sched.bm.ref_counts[4] == 0
    while a.status != Status.FINISHED:
        fake_step(sched, sched.schedule())
    out = sched.schedule()  # b comes back and recomputes prompt + its output token
    assert out.seqs[0].req is b and out.seqs[0].num_new == 9 and out.seqs[0].samples


def test_request_larger_than_pool_finishes_with_length():
    sched = Scheduler(settings(num_pages=3, max_num_batched_tokens=32))
    r = mk(7, max_tokens=10)
    sched.add(r)
    fake_step(sched, sched.schedule())  # 7 prompt tokens computed, 1 sampled: 2 pages, full pool
    fake_step(sched, sched.schedule())  # 8 computed, 9 tokens: the 9th needs a third page
    out = sched.schedule()
    assert out.finished == [r] and r.finish_reason == "length" and sched.bm.num_free == 2


def test_prefix_hits_and_salt():
    sched = Scheduler(settings(max_num_batched_tokens=64))
    prefix = list(range(10, 30))  # 20 tokens = 5 pages of 4
    a = mk(0, tokens=prefix + [1, 2])
    sched.add(a)
    fake_step(sched, sched.schedule())
    b, c = mk(0, tokens=prefix + [3]), mk(0, tokens=prefix + [3], salt="x")
    sched.add(b)
    sched.add(c)
    out = sched.schedule()
    by = {s.req: s for s in out.seqs}
    assert b.cached_tokens == 20 and by[b].start == 20 and by[b].num_new == 1
    assert b.pages[:5] == a.pages[:5]
    assert c.cached_tokens == 0 and by[c].start == 0
    # Whole prompt cached: the last page is recomputed so there is a token to sample.
    d = mk(0, tokens=list(prefix))
    sched.add(d)
    out = sched.schedule()
    assert d.cached_tokens == 16 and out.seqs[-1].num_new == 4


@pytest.mark.parametrize("caching", [True, False])
def test_thousand_random_requests_free_every_page(caching):
    rng = random.Random(caching)
    random.seed(1)
    sched = Scheduler(settings(num_pages=40, page_size=4, max_num_batched_tokens=24, max_num_seqs=6,
                               long_prefill_token_threshold=rng.choice([0, 8]),
                               max_num_partial_prefills=2, enable_prefix_caching=caching))
    shared = [rng.randrange(300) for _ in range(12)]
    live, added, aborted_prefill, aborted_decode = [], 0, 0, 0
    while added < 1000 or live:
        while added < 1000 and len(sched.waiting) < 8:
            n = rng.randint(1, 40)
            toks = (shared[:rng.randint(0, 12)] if rng.random() < 0.5 else []) + \
                [rng.randrange(300) for _ in range(n)]
            r = mk(0, max_tokens=rng.randint(1, 12), tokens=toks)
            sched.add(r)
            live.append(r)
            added += 1
        out = sched.schedule()
        done = fake_step(sched, out, token=rng.randrange(300))
        for r in done:
            live.remove(r)
        for r in list(live):
            if rng.random() < 0.03:
                if r.status == Status.RUNNING and r.remaining > 1 and r.num_computed > 0:
                    aborted_prefill += 1
                elif r.status == Status.RUNNING and r.output_ids:
                    aborted_decode += 1
                sched.finish(r, "abort")
                live.remove(r)
        sched.bm.check()
    assert aborted_prefill > 5 and aborted_decode > 5
    assert sched.num_preemptions > 0
    assert sched.bm.num_free == sched.bm.num_usable
    assert all(c == 0 for c in sched.bm.ref_counts)


def test_a_preempted_request_is_not_readmitted_in_the_same_step():
    # 11 usable pages of 4 tokens, four 10-token prompts decoding 12 tokens each, chunks of
    # 4: the pool overflows, and a victim's first chunk would fit in the pages it just freed.
    random.seed(3)
    sched = Scheduler(settings(num_pages=12, max_num_batched_tokens=16, long_prefill_token_threshold=4,
                               enable_prefix_caching=False))
    reqs = [mk(10, max_tokens=12) for _ in range(4)]
    for r in reqs:
        sched.add(r)
    high = {r: 0 for r in reqs}  # most tokens ever computed: work below it is recomputation
    recomputed = steps = 0
    while any(r.status != Status.FINISHED for r in reqs):
        out = sched.schedule()
        steps += 1
        assert not {s.req for s in out.seqs} & set(out.preempted), f"step {steps} re-admitted a victim"
        for s in out.seqs:
            recomputed += max(0, min(s.start + s.num_new, high[s.req]) - s.start)
            high[s.req] = max(high[s.req], s.start + s.num_new)
        fake_step(sched, out)
        sched.bm.check()
        assert steps < 500
    assert sched.num_preemptions > 0 and recomputed > 0
    assert sched.bm.num_free == sched.bm.num_usable
    print(f"steps={steps} preemptions={sched.num_preemptions} recomputed={recomputed}")


@pytest.mark.parametrize("chunked", [True, False])
def test_prefix_cache_hits_never_exceed_queries(chunked):
    """Both admission paths count the pages they look up, so hits <= queries in metrics."""
    sched = Scheduler(settings(chunked_prefill=chunked, max_num_batched_tokens=32))
    prompt = [random.randrange(300) for _ in range(12)]
    for _ in range(3):
        req = mk(0, max_tokens=1, tokens=list(prompt))
        sched.add(req)
        while req.status != Status.FINISHED:
            fake_step(sched, sched.schedule())
    assert sched.bm.queries == 3 * ((len(prompt) - 1) // 4)  # full pages before the last token, per admission
    assert 0 < sched.bm.hits <= sched.bm.queries
