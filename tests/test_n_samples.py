"""SamplingParams.n: one prompt, n samples. The prompt's full pages are computed once and
shared (samples 1.. take them from the prefix cache once sample 0 has prefilled); each
sample equals a single request with its seed (seed + i); aborting one frees only its own
pages; the id add_request returned aborts them all."""

import pytest

from jaxfill import Engine, SamplingParams
from jaxfill.engine.config import load_config
from jaxfill.engine.request import InvalidRequest
from fast_engine import REFERENCE_ATTENTION

ENGINE = {**REFERENCE_ATTENTION,  # tests/fast_engine.py
          "engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64], "engine.num_pages": 64,
          "engine.max_model_len": 256, "engine.max_num_seqs": 8, "engine.page_size": 16}
PROMPT = list(b"ROMEO:\nBut soft, what light through yonder win")  # 46 tokens: 2 full pages + 14
FULL = 2


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def engine(request):
    with Engine(load_config("tiny", {**ENGINE, "engine.async_scheduling": request.param}), progress=False) as e:
        yield e


@pytest.mark.slow
def test_each_sample_equals_a_single_request_with_its_seed(engine):
    done = engine.generate([PROMPT, "Hello"], [SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=7),
                                               SamplingParams(max_tokens=5)])
    assert [c.index for c in done] == [0, 1, 2, 3, 0] and len(done) == 5
    for i, c in enumerate(done[:4]):
        alone = engine.generate([PROMPT], SamplingParams(max_tokens=10, temperature=1.0, seed=7 + i))[0]
        assert c.token_ids == alone.token_ids
    assert len({tuple(c.token_ids) for c in done[:4]}) > 1  # the seeds differ
    assert done[4].token_ids == engine.generate(["Hello"], SamplingParams(max_tokens=5))[0].token_ids


def running_pages(engine, rid: str, n: int) -> list[list[int]]:
    """Steps until all n samples run; their page lists."""
    for _ in range(50):
        reqs = [engine.requests.get(x) for x in engine.sample_ids(rid, n)]
        if all(r is not None and r.status == "running" and r.output_ids for r in reqs):
            return [list(r.pages) for r in reqs]
        engine.step()
    raise AssertionError("the samples never all ran")


def test_the_prompt_pages_are_computed_once_and_shared(engine):
    engine.scheduler.replicas[0].bm.reset_prefix_cache()
    rid = engine.add_request(PROMPT, SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=1))
    pages = running_pages(engine, rid, 4)
    assert len(PROMPT) // 16 == FULL
    shared = set(pages[0][:FULL])
    assert all(set(p[:FULL]) == shared for p in pages)  # the full prompt pages, once
    tails = [set(p[FULL:]) for p in pages]
    assert all(tails) and len(set().union(*tails)) == sum(map(len, tails))  # own pages, none shared
    assert not (shared & set().union(*tails))
    done = {}
    while len(done) < 4:
        for out in engine.step():
            if out.finished and out.parent_id == rid:
                done[out.index] = out.completion
    assert done[0].cached_tokens == 0 and all(done[i].cached_tokens == 16 * FULL for i in (1, 2, 3))
    assert all(c.prompt_tokens == len(PROMPT) for c in done.values())


def test_aborting_one_sample_frees_only_its_pages(engine):
    rid = engine.add_request(PROMPT, SamplingParams(n=3, max_tokens=30, temperature=1.0, seed=3))
    pages = running_pages(engine, rid, 3)
    assert engine.abort(f"{rid}#1")
    held = {p for x in (0, 2) for p in engine.requests[f"{rid}#{x}"].pages}
    assert set(pages[0][:FULL]) <= held and not (set(pages[1][FULL:]) & held)
    finished = {}
    while len(finished) < 3:
        for out in engine.step():
            if out.finished and out.parent_id == rid:
                finished[out.index] = out.completion.finish_reason
    assert finished == {0: "length", 1: "abort", 2: "length"}
    rid = engine.add_request(PROMPT, SamplingParams(n=3, max_tokens=30))
    running_pages(engine, rid, 3)
    assert engine.abort(rid) and not any(r.parent_id == rid for r in engine.requests.values())
    engine.step()
    st = engine.stats()
    assert st["num_running"] == 0 and st["num_waiting"] == 0


def test_stream_yields_every_sample(engine):
    outs = list(engine.stream(PROMPT, SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=5)))
    finals = {o.index: o.completion for o in outs if o.finished}
    assert set(finals) == {0, 1, 2} and all(len(c.token_ids) == 4 for c in finals.values())


@pytest.mark.parametrize("n", [0, 65, 1.5])
def test_bad_n_is_refused_by_name(engine, n):
    with pytest.raises(InvalidRequest) as e:
        engine.generate(["abc"], SamplingParams(n=n))
    assert e.value.field == "n"


def test_without_prefix_caching_the_samples_still_run():
    with Engine(load_config("tiny", {**ENGINE, "engine.enable_prefix_caching": False}), progress=False) as e:
        done = e.generate([PROMPT], SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=2))
        alone = e.generate([PROMPT], SamplingParams(max_tokens=6, temperature=1.0, seed=4))[0]
    assert len(done) == 3 and done[2].token_ids == alone.token_ids
    assert all(c.cached_tokens == 0 for c in done)
