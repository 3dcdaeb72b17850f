"""Engine under notebook habits and misuse: an interrupt (KeyboardInterrupt) at each point of
a step, a KV cache lost between donation and store, two threads stepping one engine, a bad
prompt in a generate() batch, an exception in schedule().

After each: the exception reaches the caller, every page comes back, nothing is left in
flight, and a fresh generate() gives the tokens of an untouched engine. Unused KV pages
are NaN-filled, so a step that reads a page nobody wrote poisons its logits.
"""

import threading

import numpy as np
import pytest

import jaxfill.engine.step_phases as step_phases  # the build phase calls build_batch there
from jaxfill.engine.config import load_config
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import InvalidRequest, SamplingParams
from fast_engine import REFERENCE_ATTENTION

OVERRIDES = {**REFERENCE_ATTENTION,  # tests/fast_engine.py
             "engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64], "engine.num_pages": 64,
             "engine.max_model_len": 256, "engine.max_num_seqs": 8}
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    from jaxfill.engine.loading import build_model

    return build_model(load_config("tiny_random", OVERRIDES), progress=False)


def make_engine(model, async_scheduling: bool = True) -> Engine:
    config = load_config("tiny_random", {**OVERRIDES, "engine.async_scheduling": async_scheduling,
                                         "engine.kv_fill_value": float("nan")})  # rebuilt caches too
    return Engine(config, progress=False, model=model)


def prompts8():
    rng = np.random.default_rng(1)
    return [rng.integers(0, 256, n).tolist() for n in (40, 3, 25, 9, 50, 1, 17, 33)]


BYSTANDER = list(range(60, 90))  # added with add_request, not by the interrupted generate()


@pytest.fixture(scope="module")
def reference(model):
    eng = make_engine(model)
    toks = [c.token_ids for c in eng.generate(prompts8() + [BYSTANDER], GREEDY)]
    return toks[:-1], toks[-1]


def assert_clean(eng: Engine):
    st = eng.stats()
    assert st["pages_free"] == st["pages_total"]
    assert not eng.requests and not eng.has_unfinished()
    assert st["num_running"] == 0 and st["num_waiting"] == 0
    for sched in eng.scheduler.replicas:
        sched.bm.check()


def interrupt_on_call(n: int, real=None, before=None):
    """A stand-in that runs `real`, except call n: that one runs `before` (same arguments)
    if given, then raises KeyboardInterrupt."""
    calls = {"n": 0}

    def fake(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] != n:
            return real(*args, **kwargs)
        if before is not None:
            before(*args, **kwargs)
        raise KeyboardInterrupt

    return fake


def delete_cache(eng):
    for p in eng.runner.kv_cache.pages:  # donated but the successor never stored
        p.delete()


def inject(eng, monkeypatch, point: str, bystander: str) -> None:
    r = eng.runner
    if point == "schedule":  # after the scheduler admitted and allocated
        real = eng.scheduler.schedule
        monkeypatch.setattr(eng.scheduler, "schedule", interrupt_on_call(3, real, before=real))
    elif point == "build_batch":
        monkeypatch.setattr(step_phases, "build_batch", interrupt_on_call(3, step_phases.build_batch))
    elif point == "run_before_donation":
        monkeypatch.setattr(r, "run", interrupt_on_call(3, r.run))
    elif point == "run_donated_not_stored":
        monkeypatch.setattr(r, "run", interrupt_on_call(3, r.run, before=lambda batch: delete_cache(eng)))
    elif point == "run_after_store":  # the step ran and stored its cache; its results are lost
        monkeypatch.setattr(r, "run", interrupt_on_call(3, r.run, before=r.run))
    elif point == "advance":  # on the 4th row taken: some outputs of this step already made
        real = eng.scheduler.update_from_output
        monkeypatch.setattr(eng.scheduler, "update_from_output", interrupt_on_call(4, real))
    elif point == "advance_bystander":  # on the bystander's own token, taken in its first step
        real = eng.scheduler.update_from_output

        def update_from_output(sch, *a, **kw):
            if sch.req.request_id == bystander and sch.samples and not sch.req.output_ids:
                raise KeyboardInterrupt
            return real(sch, *a, **kw)

        monkeypatch.setattr(eng.scheduler, "update_from_output", update_from_output)
    elif point == "detokenize":
        real_detok = eng.tokenizer.detokenizer

        def detokenizer(*a, **kw):
            d = real_detok(*a, **kw)
            d.feed = interrupt_on_call(2, d.feed)
            return d

        monkeypatch.setattr(eng.tokenizer, "detokenizer", detokenizer)
    else:
        raise AssertionError(point)


POINTS = ["schedule", "build_batch", "run_before_donation", "run_donated_not_stored", "run_after_store",
          "advance", "advance_bystander", "detokenize"]


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("point", POINTS)
def test_interrupt_at_each_point_of_a_step(model, reference, monkeypatch, point, async_scheduling):
    ref, ref_bystander = reference
    eng = make_engine(model, async_scheduling)
    by = eng.add_request(BYSTANDER, GREEDY)
    inject(eng, monkeypatch, point, by)
    with pytest.raises(KeyboardInterrupt):
        eng.generate(prompts8(), GREEDY)
    # The interrupted generate() aborted its own requests; the bystander carries on and
    # every output it made (some were parked in the outbox) is still delivered.
    assert set(eng.requests) <= {by}
    monkeypatch.undo()
    got, final = [], None
    for _ in range(100):
        if not eng.has_unfinished():
            break
        for o in eng.step():
            assert o.request_id == by, o
            got += o.new_token_ids
            if o.finished:
                final = o.completion
    assert final is not None, "the bystander never finished"
    assert final.token_ids == ref_bystander and final.finish_reason == "length"
    assert got == ref_bystander
    assert eng.num_cache_resets == (1 if point == "run_donated_not_stored" else 0)
    assert_clean(eng)
    assert [c.token_ids for c in eng.generate(prompts8(), GREEDY)] == ref
    assert_clean(eng)


def test_abort_all_after_an_interrupted_cell(model, reference, monkeypatch):
    eng = make_engine(model)
    for p in prompts8()[:3]:
        eng.add_request(p, GREEDY)
    eng.step()
    eng.step()
    assert eng.stats()["pages_free"] < eng.stats()["pages_total"]
    assert eng.abort_all() == 3
    assert_clean(eng)
    assert eng.step() == []
    assert [c.token_ids for c in eng.generate(prompts8(), GREEDY)] == reference[0]


def test_generate_checks_every_prompt_before_adding_any(model, monkeypatch):
    eng = make_engine(model)
    added = []
    real = eng.add_request
    monkeypatch.setattr(eng, "add_request", lambda *a, **kw: added.append(a) or real(*a, **kw))
    with pytest.raises(InvalidRequest, match="prompt 2: token id 999") as e:
        eng.generate([[1, 2], [3, 4], [5, 999]], GREEDY)
    assert e.value.field == "prompt"
    with pytest.raises(InvalidRequest, match="prompt 1: is empty"):
        eng.generate([[1, 2], []], GREEDY)
    assert added == []
    assert_clean(eng)


def test_outbox_survives_an_exception_in_schedule(model, monkeypatch):
    eng = make_engine(model)
    rid = eng.add_request([1, 2, 3], GREEDY)
    eng.step()
    assert eng.abort(rid)  # its "abort" output waits in the outbox for the next step
    def broken_schedule():
        raise RuntimeError("scheduler bug")

    monkeypatch.setattr(eng.scheduler, "schedule", broken_schedule)
    with pytest.raises(RuntimeError, match="scheduler bug"):
        eng.step()
    monkeypatch.undo()
    outs = eng.step()
    assert [(o.request_id, o.completion.finish_reason) for o in outs] == [(rid, "abort")]
    assert_clean(eng)


def test_a_second_thread_cannot_step_while_one_does(model, reference, monkeypatch):
    eng = make_engine(model)
    inside, release = threading.Event(), threading.Event()
    real = eng.runner.run

    def slow_run(batch):  # holds the first stepper inside the device call
        inside.set()
        assert release.wait(timeout=30)
        return real(batch)

    monkeypatch.setattr(eng.runner, "run", slow_run)
    rid = eng.add_request(prompts8()[0], GREEDY)
    first = {}
    t = threading.Thread(target=lambda: first.setdefault("outs", eng.step()))
    t.start()
    try:
        assert inside.wait(timeout=30)
        runs_before = eng.num_steps
        with pytest.raises(RuntimeError, match="already running in another thread"):
            eng.step()
        with pytest.raises(RuntimeError, match="already running in another thread"):
            eng.generate([[1, 2, 3]], GREEDY)
        with pytest.raises(RuntimeError, match="already running in another thread"):
            next(eng.stream([1, 2, 3], GREEDY))
        with pytest.raises(RuntimeError, match="already running in another thread"):
            eng.warmup(progress=False)
        assert set(eng.requests) == {rid}  # the refused calls added nothing
        assert eng.num_steps == runs_before
    finally:
        release.set()
        t.join(timeout=60)
    assert not t.is_alive() and "outs" in first
    monkeypatch.undo()
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.completion
    assert done[rid].token_ids == reference[0][0]
    assert_clean(eng)


def test_an_owning_serving_thread_excludes_others_between_its_steps(model, reference):
    """A serving loop owns the engine for its whole life: another thread's generate() is
    refused even while the owner sits between two steps, and the owner still steps."""
    eng = make_engine(model)
    owned, done = threading.Event(), threading.Event()
    result = {}

    def owner():
        with eng.own_stepping():
            owned.set()
            assert done.wait(timeout=60)
            result["tokens"] = eng.generate([prompts8()[0]], GREEDY)[0].token_ids

    t = threading.Thread(target=owner)
    t.start()
    try:
        assert owned.wait(timeout=30)
        for call in (lambda: eng.step(), lambda: eng.generate([[1, 2, 3]], GREEDY),
                     lambda: next(eng.stream([1, 2, 3], GREEDY))):
            with pytest.raises(RuntimeError, match="stepped by a serving loop"):
                call()
        with pytest.raises(RuntimeError, match="already owned"):
            with eng.own_stepping():
                pass
        assert not eng.requests
    finally:
        done.set()
        t.join(timeout=120)
    assert result["tokens"] == reference[0][0]
    assert eng.generate([prompts8()[0]], GREEDY)[0].token_ids == reference[0][0]  # released on exit
    assert_clean(eng)
