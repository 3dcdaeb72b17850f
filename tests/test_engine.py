"""Engine end to end on a small random-init HF Llama (f32): batch = one-at-a-time = HF,
invariance across budgets / page sizes / prefix caching / preemption, prefix-cache hits,
seeds, stops, errors, aborts, and zero compilations after warm-up.

One model is loaded once; engines share it, so equal shapes share compiled programs.
"""

import random
import threading

import jax
import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="the Hugging Face reference needs torch (the test extra)")

from jaxfill.engine.config import load_config
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import InvalidRequest, QueueFull, SamplingParams
from jaxfill.engine.simple import generate_one
from jaxfill.engine.tokenizer import ByteTokenizer
from jaxfill.models.kv_cache import KVCache

pytestmark = pytest.mark.xla_attention  # the CPU default impl end to end (tests/conftest.py)

MAX_LEN = 1024
N_NEW = 12


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from hf_models import make_hf_checkpoint

    return make_hf_checkpoint(str(tmp_path_factory.mktemp("engine_hf") / "llama"), "llama")


@pytest.fixture(scope="module")
def model(hf_dir):
    from jaxfill.engine.loading import build_model

    return build_model(load_config("tiny_random", {"engine.max_model_len": MAX_LEN}, hf_dir), progress=False)


def make_engine(hf_dir, model, **engine):
    over = {"engine.max_model_len": MAX_LEN, "engine.num_pages": 160, "engine.max_num_seqs": 16,
            "engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64]}
    over.update({f"engine.{k}": v for k, v in engine.items()})
    return Engine(load_config("tiny_random", over, hf_dir), progress=False, model=model)


def prompts16():
    rng = np.random.default_rng(0)
    lengths = [3, 31, 7, 16, 1, 29, 12, 5, 30, 17, 9, 24, 2, 32, 15, 20]
    return [rng.integers(0, 512, n).tolist() for n in lengths]


GREEDY = SamplingParams(max_tokens=N_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(model):
    """engine/simple.py generate_one, one prompt at a time."""
    outs = []
    for p in prompts16():
        cache = KVCache.create(model.config, 8, 16)
        toks, _ = generate_one(model, p, cache, N_NEW, pages=list(range(1, 8)))
        outs.append(toks)
    return outs


@pytest.fixture(scope="module")
def base(hf_dir, model):
    return make_engine(hf_dir, model)


def test_batch_of_16_equals_one_at_a_time_and_hf(base, reference, hf_dir):
    got = base.generate(prompts16(), GREEDY)
    assert [c.token_ids for c in got] == reference
    assert all(c.finish_reason == "length" for c in got)
    from hf_models import load_hf

    hf = load_hf(hf_dir)
    with torch.no_grad():
        for p, ref in list(zip(prompts16(), reference))[:6]:
            out = hf.generate(torch.tensor([p]), max_new_tokens=N_NEW, do_sample=False,
                              eos_token_id=None, pad_token_id=0, min_new_tokens=N_NEW)
            assert out[0, len(p):].tolist() == ref
    assert base.stats()["pages_free"] == base.stats()["pages_total"]


@pytest.mark.parametrize("engine_kw", [
    dict(max_num_batched_tokens=16, token_buckets=[16]),
    dict(max_num_batched_tokens=512, token_buckets=[16, 64, 512]),
    dict(enable_prefix_caching=False),
    dict(page_size=32, token_buckets=[64]),
    dict(page_size=8, num_pages=24, max_num_partial_prefills=2, token_buckets=[64]),  # tiny pool: preemption
], ids=["budget16", "budget512", "no_prefix_cache", "page32", "page8_preempt"])
def test_tokens_invariant(hf_dir, model, reference, engine_kw):
    eng = make_engine(hf_dir, model, **engine_kw)
    # Twice: the second round hits the prefix cache (when on) for every prompt's full pages.
    for _ in range(2):
        got = eng.generate(prompts16(), GREEDY)
        assert [c.token_ids for c in got] == reference
    st = eng.stats()
    if engine_kw.get("num_pages") == 24:
        assert st["num_preemptions"] > 0
    if engine_kw.get("enable_prefix_caching", True) and engine_kw.get("page_size", 16) == 16:
        assert st["cached_tokens_total"] > 0
    assert st["pages_free"] == st["pages_total"]


def test_prefix_cache_reports_whole_shared_pages(base):
    rng = np.random.default_rng(5)
    prefix = rng.integers(0, 512, 1000).tolist()
    p = SamplingParams(max_tokens=2, ignore_eos=True)
    first = base.generate([prefix + [1, 2, 3]], p)[0]
    assert first.cached_tokens == 0
    second = base.generate([prefix + [7, 8]], p)[0]
    assert second.cached_tokens == (1000 // 16) * 16
    salted = base.generate([prefix + [7, 8]], SamplingParams(max_tokens=2, ignore_eos=True, cache_salt="other"))[0]
    assert salted.cached_tokens == 0
    # Same tokens whether the prefix came from the cache or not.
    assert salted.token_ids == second.token_ids


def test_same_seed_same_tokens_alone_or_in_full_batch(base):
    sp = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = base.generate([[5, 6, 7, 8]], sp)[0].token_ids
    rng = random.Random(0)
    others = [[rng.randrange(512) for _ in range(rng.randint(1, 30))] for _ in range(15)]
    params = [SamplingParams(max_tokens=10, temperature=rng.choice([0.0, 0.8, 1.5]), top_k=rng.choice([0, 5]),
                             ignore_eos=True) for _ in others]
    batch = base.generate(others[:7] + [[5, 6, 7, 8]] + others[7:], params[:7] + [sp] + params[7:])
    assert batch[7].token_ids == alone
    again = base.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=99,
                                                        ignore_eos=True))[0].token_ids
    assert again != alone


def test_stops_and_limits(base):
    eng = base
    ref = eng.generate([[10, 20, 30]], GREEDY)[0].token_ids
    # stop token id
    c = eng.generate([[10, 20, 30]], SamplingParams(max_tokens=N_NEW, ignore_eos=True, stop_token_ids=(ref[3],)))[0]
    assert c.finish_reason == "stop" and c.token_ids == ref[:ref.index(ref[3]) + 1]
    # EOS (here: pretend the model's eos id is ref[2]) ends the request unless ignore_eos
    rid = eng.add_request([10, 20, 30], SamplingParams(max_tokens=N_NEW))
    eng.requests[rid].eos_token_ids = (ref[2],)
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                assert o.completion.finish_reason == "stop" and o.completion.token_ids == ref[:3]
    # max_model_len
    long_prompt = [i % 500 + 1 for i in range(MAX_LEN - 3)]
    c = eng.generate([long_prompt], GREEDY)[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 3


def test_stop_strings_never_reach_the_text(hf_dir, model):
    eng = make_engine(hf_dir, model)
    tok = ByteTokenizer(512)
    eng.tokenizer = tok  # this engine's own (the test checkpoint ships no tokenizer.json)
    # Random weights: not every output decodes to clean text. Take the first prompt whose
    # text has a two-character stop string (no replacement character) after some text.
    rng = np.random.default_rng(11)
    prompts = [rng.integers(32, 127, 6).tolist() for _ in range(16)]
    found = None
    for prompt, c in zip(prompts, eng.generate(prompts, GREEDY)):
        text = tok.decode(c.token_ids)
        for i in range(1, len(text) - 1):
            if "\ufffd" not in text[i:i + 2]:
                found = prompt, text, text[i:i + 2]
                break
        if found:
            break
    assert found, "no prompt gave a usable stop string"
    prompt, text, stop = found
    chunks = list(eng.stream(prompt, SamplingParams(max_tokens=N_NEW, ignore_eos=True, stop=stop)))
    final = chunks[-1].completion
    assert final.finish_reason == "stop" and stop not in final.text
    assert final.text == text[:text.find(stop)]
    assert "".join(ch.new_text for ch in chunks) == final.text


def test_invalid_requests_and_queue_full(hf_dir, model, base):
    with pytest.raises(InvalidRequest) as e:
        base.add_request([1, 2, 99999], GREEDY)
    assert e.value.field == "prompt"
    with pytest.raises(InvalidRequest):
        base.add_request(list(range(MAX_LEN)), GREEDY)
    with pytest.raises(InvalidRequest):
        base.add_request([], GREEDY)
    with pytest.raises(InvalidRequest) as e:
        base.add_request([1], SamplingParams(top_p=0.0))
    assert e.value.field == "top_p"
    rid = base.add_request([1, 2], GREEDY, request_id="dup")
    with pytest.raises(InvalidRequest) as e:
        base.add_request([1, 2], GREEDY, request_id="dup")
    assert e.value.field == "request_id"
    assert base.abort(rid)
    assert not base.abort("nope")
    outs = base.step()
    assert [o.completion.finish_reason for o in outs if o.request_id == rid] == ["abort"]
    small = make_engine(hf_dir, model, max_waiting=2)
    small.add_request([1], GREEDY)
    small.add_request([1], GREEDY)
    with pytest.raises(QueueFull):
        small.add_request([1], GREEDY)


def test_abort_frees_pages_at_once_and_metrics(base):
    eng = base
    st0 = eng.stats()
    a = eng.add_request(list(range(1, 200)), SamplingParams(max_tokens=50, ignore_eos=True))
    b = eng.add_request([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()  # a mid-prefill (budget 64), b prefilled
    eng.step()
    assert eng.stats()["pages_free"] < st0["pages_free"]
    assert eng.abort(a) and eng.abort(b)
    assert eng.stats()["pages_free"] == st0["pages_free"]
    outs = eng.step()
    assert {o.request_id: o.completion.finish_reason for o in outs} == {a: "abort", b: "abort"}
    assert not eng.has_unfinished()
    c = eng.generate([[4, 5, 6]], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    m = c.metrics
    for k in ("arrival_time", "queue_s", "ttft_s", "prefill_s", "tpot_s", "e2e_s"):
        assert k in m and m[k] >= 0
    assert m["ttft_s"] <= m["e2e_s"] and m["queue_s"] <= m["ttft_s"]


def test_failing_step_finishes_requests_with_error_and_engine_continues(base, reference, monkeypatch):
    eng = base
    real = eng.runner.run
    calls = {"n": 0}

    def boom(batch):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        return real(batch)

    monkeypatch.setattr(eng.runner, "run", boom)
    rid = eng.add_request(prompts16()[1], GREEDY)
    finished = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o.completion
    assert finished[rid].finish_reason == "error" and "injected" in finished[rid].error
    assert eng.stats()["pages_free"] == eng.stats()["pages_total"]
    monkeypatch.setattr(eng.runner, "run", real)
    assert eng.generate([prompts16()[1]], GREEDY)[0].token_ids == reference[1]


def test_a_step_that_loses_the_donated_cache_rebuilds_it_and_recomputes(hf_dir, model, reference,
                                                                        monkeypatch):
    eng = make_engine(hf_dir, model, kv_fill_value=float("nan"))  # a stale page poisons what reads it
    cached = list(range(100, 150))  # its 3 full pages go into the prefix cache before the failure
    cached_ref = eng.generate([cached], GREEDY)[0].token_ids
    real_run, real_schedule = eng.runner.run, eng.scheduler.schedule
    seen = {}

    def schedule():
        # The failing step leaves one running, partly computed request out (as a full token
        # budget does): it is not failed with the step, so it must be recomputed.
        scheds = real_schedule()
        decodes = [sch for sch in scheds[0].seqs if sch.start > 0]
        if "failed" not in seen and len(decodes) >= 2:
            scheds[0].seqs.remove(decodes[-1])
            seen["failed"] = {sch.req.request_id for sch in scheds[0].seqs}, decodes[-1].req.request_id
        return scheds

    def run(batch):
        if seen.get("failed") and "raised" not in seen:
            seen["raised"] = True
            for p in eng.runner.kv_cache.pages:
                p.delete()  # donated, as a failing device step leaves it
            raise RuntimeError("injected after donation")
        return real_run(batch)

    monkeypatch.setattr(eng.scheduler, "schedule", schedule)
    monkeypatch.setattr(eng.runner, "run", run)
    rids = [eng.add_request(p, GREEDY) for p in prompts16()]
    done = {}
    for _ in range(1000):
        if not eng.has_unfinished():
            break
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.completion
    failed, left_out = seen["failed"]
    for rid, ref in zip(rids, reference):
        c = done[rid]
        if rid in failed:
            assert c.finish_reason == "error" and "injected" in c.error
        else:
            assert c.token_ids == ref, rid
    assert left_out not in failed and done[left_out].token_ids == reference[rids.index(left_out)]
    assert eng.stats()["num_cache_resets"] == 1
    assert eng.stats()["pages_free"] == eng.stats()["pages_total"]
    # The prefix cache was emptied with the cache: no stale hit on the lost pages.
    again = eng.generate([cached], GREEDY)[0]
    assert again.token_ids == cached_ref and again.cached_tokens == 0


def test_logprobs_and_threaded_add(base):
    c = base.generate([[1, 2, 3]], SamplingParams(max_tokens=4, logprobs=3, ignore_eos=True))[0]
    assert len(c.logprobs) == 4
    for tok, lp in zip(c.token_ids, c.logprobs):
        assert lp["token_id"] == tok and len(lp["top"]) == 3
        assert lp["top"][0][0] == tok  # greedy picks the top token
        assert abs(lp["logprob"] - lp["top"][0][1]) < 1e-6
    # add_request from other threads while this thread steps
    ids = []

    def adder(k):
        for i in range(5):
            ids.append(base.add_request([k, i + 1], SamplingParams(max_tokens=3, ignore_eos=True)))

    threads = [threading.Thread(target=adder, args=(k,)) for k in range(1, 4)]
    for t in threads:
        t.start()
    done = set()
    while any(t.is_alive() for t in threads) or base.has_unfinished():
        for o in base.step():
            if o.finished:
                done.add(o.request_id)
    assert done == set(ids) and len(ids) == 15


def test_zero_compilations_after_warmup_random_workload(base):
    compiles = []

    def listener(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        size0 = base.stats()["compiled_programs"]
        rng = random.Random(7)
        pending = 300
        live = []
        while pending or base.has_unfinished():
            while pending and len(live) < 24:
                p = [rng.randrange(512) for _ in range(rng.randint(1, 60))]
                sp = SamplingParams(max_tokens=rng.randint(1, 6), temperature=rng.choice([0.0, 0.7, 1.2]),
                                    top_k=rng.choice([0, 3, 50]), top_p=rng.choice([1.0, 0.9]),
                                    min_p=rng.choice([0.0, 0.1]), seed=rng.choice([None, rng.randrange(10**6)]),
                                    repetition_penalty=rng.choice([1.0, 1.3]),
                                    frequency_penalty=rng.choice([0.0, 0.5]),
                                    logprobs=rng.choice([None, 2]), ignore_eos=rng.random() < 0.5)
                live.append(base.add_request(p, sp))
                pending -= 1
            for o in base.step():
                if o.finished:
                    live.remove(o.request_id)
            if live and rng.random() < 0.05:
                base.abort(rng.choice(live))
        assert compiles == [], f"{len(compiles)} compilations after warm-up"
        assert base.stats()["compiled_programs"] == size0
        assert base.stats()["pages_free"] == base.stats()["pages_total"]
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
