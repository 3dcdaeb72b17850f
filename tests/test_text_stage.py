"""Engine.defer_text + serving/text_stage.py (text off the engine thread) give what the
inline path gives: the same streamed ids and text, stop strings never in the text, the
same completions, with async scheduling on; every page comes back."""

import time

import pytest

from jaxfill.serving.text_stage import TextStage
from test_async_scheduling import (SMALL_POOL, assert_clean, assert_same_logprobs, drive, make_engine,  # noqa: F401
                                   mixed_requests, model, prompts, reference, seeded, stop_index)


def drive_deferred(eng, requests, abort_after: dict[str, int] = {}, lag: int = 0):
    """drive(), with the engine's text left to a TextStage fed in output order, `lag`
    step() calls late (a serving event loop renders while the engine thread steps on, so
    the engine may send tokens past a stop string before it hears of it)."""
    assert eng.defer_text
    stage = TextStage(eng.tokenizer)
    streamed = {rid: ([], []) for rid, _, _ in requests}
    done = {}
    for rid, prompt, params in requests:
        stage.start(rid, prompt, params)
        eng.add_request(prompt, params, request_id=rid)
    late = []  # one list of raw outputs per step(), oldest first
    dropped = 0
    for _ in range(2000):
        if not eng.has_unfinished() and not late:
            break
        late.append(eng.step() if eng.has_unfinished() else [])
        if len(late) <= lag and eng.has_unfinished():
            continue
        for raw in late.pop(0):
            o, stop_at = stage.render(raw)
            if o is None:
                dropped += 1
                continue
            if stop_at is not None:
                eng.stop_at(o.request_id, stop_at)
            ids, text = streamed[o.request_id]
            ids += o.new_token_ids
            text.append(o.new_text)
            if o.finished:
                done[o.request_id] = o.completion
                stage.drop(o.request_id)
            elif len(ids) >= abort_after.get(o.request_id, 1 << 30):
                eng.abort(o.request_id)
    return {rid: (ids, "".join(text), done[rid]) for rid, (ids, text) in streamed.items()}, dropped


@pytest.mark.slow
@pytest.mark.parametrize("pool,lag", [("big", 0), ("big", 2), ("small", 2)])
def test_deferred_text_gives_what_inline_text_gives(model, reference, pool, lag):
    s4 = reference["s4"][2].token_ids
    extra = {"model.eos_token_id": [s4[stop_index(s4, 3)]]}
    if pool == "small":
        extra.update(SMALL_POOL)
    s3 = reference["s3"][2].text
    inline_eng = make_engine(model, False, **extra)
    s3_ids = reference["s3"][2].token_ids
    hit = next(k for k in range(1, len(s3_ids) + 1) if s3[5:7] in inline_eng.tokenizer.decode(s3_ids[:k]))
    requests = mixed_requests(reference) + [
        # a stop string two tokens long, and one the text never contains
        ("stop_str2", prompts()[3], seeded(3, stop=(s3[6:8], "\x00never\x00"), logprobs=1)),
        # max_tokens ends it one token after the stop string: with lag, before the engine hears
        ("stop_str_then_length", prompts()[3], seeded(3, stop=(s3[5:7],), max_tokens=hit + 1)),
    ]
    inline = drive(inline_eng, requests, abort_after={"aborted": 3})
    eng = make_engine(model, True, defer_text=True, **extra)
    deferred, dropped = drive_deferred(eng, requests, abort_after={"aborted": 3}, lag=lag)
    assert (dropped > 0) == (lag > 0)  # with lag, tokens past a stop string came and were dropped
    assert_clean(eng)
    for rid, _, _ in requests:
        (ids0, text0, c0), (ids1, text1, c1) = inline[rid], deferred[rid]
        if rid == "aborted" and lag:  # the abort lands `lag` steps later: more tokens, same prefix
            assert ids1 == c1.token_ids and ids1[:3] == ids0 and c1.finish_reason == "abort"
            assert ids1 == reference["s7"][0][:len(ids1)]
            continue
        assert ids1 == ids0 == c0.token_ids == c1.token_ids, rid
        assert text1 == text0 == c0.text == c1.text, rid
        assert c1.finish_reason == c0.finish_reason, rid
        assert_same_logprobs(c1.logprobs, c0.logprobs)
    assert inline["stop_str"][2].finish_reason == "stop" and inline["stop_str2"][2].finish_reason == "stop"
    assert s3[6:8] not in inline["stop_str2"][1]


def test_stop_strings_over_grpc_match_engine_generate(tmp_path_factory):
    """The serving loop renders text on the event loop while the engine thread steps on:
    streams with stop strings (and stop ids, logprobs) equal the inline Engine.generate."""
    import asyncio

    from jaxfill.engine.config import load_config
    from jaxfill.engine.engine import Engine
    from jaxfill.engine.request import SamplingParams
    from jaxfill.serving.client import AsyncClient
    from jaxfill.serving.server import ServerThread
    from serving_util import compile_cache_dir

    compile_cache_dir(tmp_path_factory)
    overrides = {"engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64], "engine.num_pages": 64,
                 "engine.max_model_len": 256, "engine.max_num_seqs": 8}
    engine = Engine(load_config("tiny_random", overrides), progress=False)
    ps = prompts()
    plain = [dict(max_tokens=14, temperature=1.0, seed=200 + i, ignore_eos=True) for i in range(len(ps))]
    texts = [c.text for c in engine.generate(ps, [SamplingParams(**p) for p in plain])]
    kws = [dict(p, stop=[t[4:6]], logprobs=1 if i % 2 else None) for i, (p, t) in enumerate(zip(plain, texts))]
    reference = engine.generate(ps, [SamplingParams(**k) for k in kws])
    assert sum(c.finish_reason == "stop" and len(c.token_ids) < 14 for c in reference) >= 5
    with ServerThread(engine, host="127.0.0.1", port=0, metrics_port=0) as st:
        assert st.wait_ready(600)

        async def go():
            async with AsyncClient(st.address) as c:
                return await asyncio.gather(*[c.generate(p, timeout=120, request_id=f"s-{i}",
                                                         **{k: v for k, v in kw.items() if v is not None})
                                              for i, (p, kw) in enumerate(zip(ps, kws))])

        results = asyncio.run(asyncio.wait_for(go(), 120))
        for i, (got, want) in enumerate(zip(results, reference)):
            assert got.token_ids == want.token_ids, i
            assert got.text == want.text and kws[i]["stop"][0] not in got.text, i
            assert got.finish_reason == want.finish_reason, i
        deadline = time.time() + 10
        while engine.stats()["pages_free"] != engine.stats()["pages_total"] and time.time() < deadline:
            time.sleep(0.05)
        assert engine.stats()["pages_free"] == engine.stats()["pages_total"]
