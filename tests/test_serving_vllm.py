"""vllm.grpc.engine.VllmEngine (what the smg gateway speaks) on a real server on 127.0.0.1,
driven by the smg-grpc-proto stubs: tokens equal Engine.generate, usage, prefix-cache hits,
stops, logprobs, refused fields, Abort, info RPCs, health around warm-up, KV events."""

from __future__ import annotations

import dataclasses
import io
import hashlib
import math
import os
import threading
import time
import zipfile

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as spb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as spb_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from jaxfill.engine.config import load_config
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
from jaxfill.serving.server import ServerThread
from jaxfill.serving.vllm_convert import DEFAULT_TEMPERATURE, sampling_from_proto
from jaxfill.serving.vllm_service import served_name
from serving_util import ServeProcess, compile_cache_dir
from fast_engine import REFERENCE_ATTENTION

OVERRIDES = {**REFERENCE_ATTENTION,  # tests/fast_engine.py
             "engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64], "engine.num_pages": 64,
             "engine.max_model_len": 256}
PAGE = 16
MAX = 8
PROMPTS = [[(i * 31 + j * 17) % 256 for j in range(n)] for i, n in enumerate([1, 5, 17, 40, 100])]
LP_PROMPT = [(7 * j + 3) % 256 for j in range(23)]
STOP_PROMPT = [(5 * j + 1) % 256 for j in range(30)]
SERVED_NAME = "jf-test"


def _sp(**kw) -> vpb.SamplingParams:
    kw.setdefault("temperature", 0.0)
    return vpb.SamplingParams(**kw)


def _req(ids, rid, stream=False, **kw) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(request_id=rid, tokenized=vpb.TokenizedInput(input_ids=ids),
                               sampling_params=_sp(**kw), stream=stream)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The server, and what HealthCheck / Generate said while warm-up was held back."""
    compile_cache_dir(tmp_path_factory)
    engine = Engine(load_config("tiny_random", OVERRIDES), progress=False, warmup=False)
    ref = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX, ignore_eos=True))
    ref_lp = engine.generate([LP_PROMPT], SamplingParams(max_tokens=MAX, ignore_eos=True, logprobs=2))[0]
    ref_plp = engine.generate([PROMPTS[3]], SamplingParams(max_tokens=2, prompt_logprobs=2))[0].prompt_logprobs
    engine.scheduler.replicas[0].bm.reset_prefix_cache()  # the server's cache tests start cold
    gate = threading.Event()
    real_warmup = engine.warmup
    engine.warmed_up = False

    def gated_warmup(*a, **k):
        gate.wait(60)
        real_warmup(*a, **k)

    engine.warmup = gated_warmup
    before = {"prompt_logprobs": ref_plp}  # and, below, what the server said before warm-up
    with ServerThread(engine, host="127.0.0.1", port=0, served_model_name=SERVED_NAME) as st:
        with grpc.insecure_channel(st.address) as ch:
            stub = vpb_grpc.VllmEngineStub(ch)
            before["health"] = stub.HealthCheck(vpb.HealthCheckRequest(), timeout=10)
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(_req([1, 2, 3], "early", max_tokens=2), timeout=10))
            before["generate_code"] = e.value.code()
        gate.set()
        assert st.wait_ready(600), "server never became ready"
        with grpc.insecure_channel(st.address) as ch:
            yield st, engine, vpb_grpc.VllmEngineStub(ch), ref, ref_lp, before


def _run(stub, req, timeout=60):
    return list(stub.Generate(req, timeout=timeout))


@pytest.mark.slow
def test_health_only_after_warmup(served):
    _st, _engine, stub, _ref, _lp, before = served
    assert not before["health"].healthy and "warming" in before["health"].message
    assert before["generate_code"] == grpc.StatusCode.UNAVAILABLE
    assert stub.HealthCheck(vpb.HealthCheckRequest(), timeout=10).healthy


def test_not_taken_for_sglang(served):
    """smg probes each runtime's HealthCheck; only vLLM's may answer."""
    st = served[0]
    with grpc.insecure_channel(st.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            spb_grpc.SglangSchedulerStub(ch).HealthCheck(spb.HealthCheckRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_greedy_tokens_equal_engine_generate_streaming_and_not(served):
    _st, _engine, stub, ref, _lp, _ = served
    for i, (ids, want) in enumerate(zip(PROMPTS, ref)):
        (only,) = _run(stub, _req(ids, f"plain-{i}", max_tokens=MAX, ignore_eos=True))
        c = only.complete
        assert list(c.output_ids) == want.token_ids, i
        assert (c.finish_reason, c.prompt_tokens, c.completion_tokens) == ("length", len(ids), MAX)
        out = _run(stub, _req(ids, f"stream-{i}", stream=True, max_tokens=MAX, ignore_eos=True))
        chunks, last = [r.chunk for r in out[:-1]], out[-1]
        assert all(r.WhichOneof("response") == "chunk" for r in out[:-1]) and last.HasField("complete")
        assert [t for ch in chunks for t in ch.token_ids] == want.token_ids, i
        assert [ch.completion_tokens for ch in chunks] == list(range(1, MAX + 1))
        assert all(ch.prompt_tokens == len(ids) for ch in chunks)
        assert list(last.complete.output_ids) == want.token_ids
        assert last.complete.completion_tokens == MAX and last.complete.finish_reason == "length"


def test_text_input_is_tokenized_with_bos(served):
    _st, engine, stub, _ref, _lp, _ = served
    (r,) = _run(stub, vpb.GenerateRequest(request_id="text", text="hello there", sampling_params=_sp(max_tokens=3)))
    assert r.complete.prompt_tokens == len(engine.tokenizer.encode("hello there")) == len("hello there") + 1


def test_cached_tokens_on_a_repeated_prefix(served):
    _st, _engine, stub, _ref, _lp, _ = served
    ids = [(11 * j + 5) % 256 for j in range(100)]  # 6 full pages before the last token
    first = _run(stub, _req(ids, "cache-1", stream=True, max_tokens=2))
    second = _run(stub, _req(ids, "cache-2", stream=True, max_tokens=2))
    assert first[-1].complete.cached_tokens == 0
    assert second[-1].complete.cached_tokens == 6 * PAGE
    assert all(r.chunk.cached_tokens == 6 * PAGE for r in second[:-1])


def test_stop_token_ids_and_stop_strings_match_engine(served):
    _st, engine, stub, ref, _lp, _ = served
    ids, full = PROMPTS[4], ref[4].token_ids
    stop_id = full[2]
    (r,) = _run(stub, _req(ids, "stop-id", max_tokens=MAX, ignore_eos=True, stop_token_ids=[stop_id]))
    want = full[:full.index(stop_id) + 1]
    assert list(r.complete.output_ids) == want and len(want) < MAX
    assert r.complete.finish_reason == "stop" and r.complete.matched_token_id == stop_id
    # A stop string: the text of an ASCII byte first generated after the first token.
    ids, full = PROMPTS[1], ref[1].token_ids
    k = next(i for i, t in enumerate(full) if i > 0 and t < 128 and t not in full[:i])
    stop = chr(full[k])
    (r,) = _run(stub, _req(ids, "stop-str", max_tokens=MAX, ignore_eos=True, stop=[stop]))
    assert r.complete.finish_reason == "stop" and r.complete.matched_stop_str == stop
    assert list(r.complete.output_ids) == full[:k + 1]


def test_logprobs_streamed_and_final(served):
    _st, _engine, stub, _ref, ref_lp, _ = served
    out = _run(stub, _req(LP_PROMPT, "lp-stream", stream=True, max_tokens=MAX, ignore_eos=True, logprobs=2))
    lps = [r.chunk.output_logprobs for r in out[:-1]]
    got_ids = [t for lp in lps for t in lp.token_ids]
    got_lp = [v for lp in lps for v in lp.token_logprobs]
    assert got_ids == ref_lp.token_ids
    for v, want in zip(got_lp, ref_lp.logprobs):
        assert math.isclose(v, want["logprob"], rel_tol=1e-4, abs_tol=1e-4)
    assert all(len(t.values) == 2 and len(t.token_ids) == 2 for lp in lps for t in lp.top_logprobs)
    (r,) = _run(stub, _req(LP_PROMPT, "lp-plain", max_tokens=MAX, ignore_eos=True, logprobs=2))
    assert list(r.complete.output_logprobs.token_ids) == ref_lp.token_ids
    assert len(r.complete.output_logprobs.top_logprobs) == MAX


UNSUPPORTED = [
    ("sampling_params.structural_tag", dict(structural_tag="{}")),
    ("sampling_params.prompt_logprobs", dict(prompt_logprobs=-1)),
    ("sampling_params.logprobs", dict(logprobs=-1)),
]


@pytest.mark.parametrize("field,kw", UNSUPPORTED, ids=[f for f, _ in UNSUPPORTED])
def test_unsupported_sampling_field_is_refused_by_name(served, field, kw):
    stub = served[2]
    with pytest.raises(grpc.RpcError) as e:
        _run(stub, _req([1, 2, 3], "bad", max_tokens=2, **kw))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(field + ":"), e.value.details()


def test_truncate_prompt_tokens_keeps_the_end(served):
    """An over-long prompt with truncate_prompt_tokens = N runs as its last N tokens (the
    same tokens as sending those alone); N < 1 is refused by name."""
    stub = served[2]
    long = [(7 * i) % 250 + 1 for i in range(5000)]  # over max_model_len
    (cut,) = _run(stub, _req(long, "trunc", max_tokens=4, truncate_prompt_tokens=20))
    (alone,) = _run(stub, _req(long[-20:], "trunc-ref", max_tokens=4))
    assert list(cut.complete.output_ids) == list(alone.complete.output_ids)
    assert cut.complete.prompt_tokens == 20
    with pytest.raises(grpc.RpcError) as e:
        _run(stub, _req([1, 2, 3], "trunc-bad", max_tokens=2, truncate_prompt_tokens=-1))
    assert e.value.details().startswith("sampling_params.truncate_prompt_tokens:"), e.value.details()


def test_logit_bias_and_min_tokens_are_honoured(served):
    stub = served[2]
    (r,) = _run(stub, _req([1, 2, 3], "bias", max_tokens=4, logit_bias={65: 100.0}))
    assert list(r.complete.output_ids) == [65] * 4
    eos = 257  # tiny_random's
    (r,) = _run(stub, _req([1, 2, 3], "min-tokens", max_tokens=8, logit_bias={eos: 100.0}, min_tokens=3))
    assert list(r.complete.output_ids)[-1] == eos and len(r.complete.output_ids) == 4
    assert r.complete.finish_reason == "stop"
    with pytest.raises(grpc.RpcError) as e:
        _run(stub, _req([1, 2, 3], "bad-bias", max_tokens=2, logit_bias={5: 500.0}))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("sampling_params.logit_bias:"), e.value.details()


def test_prompt_logprobs_come_back_as_input_logprobs(served):
    """Streaming: in the first chunk; not streaming: in the complete message. Values equal
    Engine.generate's; the first prompt token has none."""
    _st, _engine, stub, _ref, _lp, before = served
    ids, want = PROMPTS[3], before["prompt_logprobs"]
    (r,) = _run(stub, _req(ids, "plp", max_tokens=2, prompt_logprobs=2))
    chunks = _run(stub, _req(ids, "plp-stream", stream=True, max_tokens=2, prompt_logprobs=2))
    streamed = [c.chunk.input_logprobs for c in chunks if c.HasField("chunk") and c.chunk.HasField("input_logprobs")]
    assert len(streamed) == 1 and chunks[0].chunk.HasField("input_logprobs")
    for got in (r.complete.input_logprobs, streamed[0]):
        assert list(got.token_ids) == ids and not got.token_logprobs[0].HasField("value")
        for e, g, top in zip(want[1:], got.token_logprobs[1:], got.top_logprobs[1:]):
            assert math.isclose(g.value, e["logprob"], rel_tol=1e-5, abs_tol=1e-5)
            assert list(top.token_ids) == [t for t, _ in e["top"]]


def test_n_samples_come_back_indexed_and_seeded(served):
    """n = 3: three complete messages (index 0..2), sample i equal to one request seeded
    seed + i; streaming chunks carry their sample's index."""
    stub = served[2]
    ids = PROMPTS[3]
    got = _run(stub, _req(ids, "n3", max_tokens=6, temperature=1.0, seed=11, n=3))
    completes = {r.complete.index: list(r.complete.output_ids) for r in got if r.HasField("complete")}
    assert sorted(completes) == [0, 1, 2]
    for i in range(3):
        (alone,) = _run(stub, _req(ids, f"n3-ref{i}", max_tokens=6, temperature=1.0, seed=11 + i))
        assert completes[i] == list(alone.complete.output_ids)
    chunks = _run(stub, _req(ids, "n3-stream", stream=True, max_tokens=6, temperature=1.0, seed=11, n=3))
    per = {}
    for r in chunks:
        if r.HasField("chunk"):
            per.setdefault(r.chunk.index, []).extend(r.chunk.token_ids)
    assert per == completes


def test_structured_output_constraints_are_honoured(served):
    """Each constraint of the oneof ends in text it accepts (token ids: tiny_random's bytes);
    a malformed one is INVALID_ARGUMENT naming its field and runs nothing."""
    import json
    import re

    stub = served[2]
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False}
    cases = {"regex": (dict(regex="[0-9]{2}-[a-z]"), lambda t: re.fullmatch("[0-9]{2}-[a-z]", t)),
             "json_schema": (dict(json_schema=json.dumps(schema)), lambda t: json.loads(t).keys() == {"a"}),
             "choice": (dict(choice=vpb.ChoiceConstraint(choices=["yes", "no"])), lambda t: t in ("yes", "no")),
             "grammar": (dict(grammar='root ::= "x" [0-9] [0-9]'), lambda t: re.fullmatch("x[0-9]{2}", t))}
    for kind, (kw, ok) in cases.items():
        for seed in range(3):
            (r,) = _run(stub, _req([1, 2, 3], f"so-{kind}-{seed}", max_tokens=40, temperature=1.0, seed=seed, **kw))
            text = bytes(t for t in r.complete.output_ids if t < 256).decode()
            assert r.complete.finish_reason == "stop" and ok(text), (kind, text)
    for kw, field in ((dict(regex="([a-z"), "regex"), (dict(json_schema="{oops"), "json_schema"),
                      (dict(choice=vpb.ChoiceConstraint()), "choice")):
        with pytest.raises(grpc.RpcError) as e:
            _run(stub, _req([1, 2, 3], "so-bad", max_tokens=4, **kw))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith(f"sampling_params.{field}:"), e.value.details()


@pytest.mark.parametrize("field,extra", [
    ("mm_inputs", dict(mm_inputs=vpb.MultimodalInputs(mm_hashes=["x"]))),
    ("kv_transfer_params_json", dict(kv_transfer_params_json="[]")),  # must be a JSON object
    ("data_parallel_rank", dict(data_parallel_rank=1)),  # this worker has mesh.data = 1: rank 0 only
    ("media_refs", dict(media_refs=vpb.MediaRefs())),
])
def test_unsupported_request_field_is_refused_by_name(served, field, extra):
    stub = served[2]
    req = vpb.GenerateRequest(request_id="bad", tokenized=vpb.TokenizedInput(input_ids=[1, 2]),
                              sampling_params=_sp(max_tokens=2), **extra)
    with pytest.raises(grpc.RpcError) as e:
        _run(stub, req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(field + ":"), e.value.details()


def test_data_parallel_rank_in_range_is_served(served):
    """smg pins data-parallel ranks: rank 0 of a one-replica worker is served as usual
    (tests/test_kv_transfer_data.py pins rank 1 of two)."""
    _st, _engine, stub, ref, _lp, _ = served
    req = vpb.GenerateRequest(request_id="dp0", tokenized=vpb.TokenizedInput(input_ids=PROMPTS[3]),
                              sampling_params=_sp(max_tokens=MAX, ignore_eos=True), data_parallel_rank=0)
    assert list(_run(stub, req)[-1].complete.output_ids) == ref[3].token_ids


def test_gateway_filled_defaults_are_accepted(served):
    """What smg fills in for every request (NOTES.md) must not be refused."""
    _st, _engine, stub, ref, _lp, _ = served
    sp = vpb.SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, frequency_penalty=0.0,
                            presence_penalty=0.0, repetition_penalty=1.0, n=1, skip_special_tokens=True,
                            spaces_between_special_tokens=True, max_tokens=MAX, ignore_eos=True)
    req = vpb.GenerateRequest(request_id="chatcmpl-1", tokenized=vpb.TokenizedInput(
        original_text="x", input_ids=PROMPTS[3]), sampling_params=sp, stream=True)
    out = _run(stub, req)
    assert list(out[-1].complete.output_ids) == ref[3].token_ids


def test_sampling_mapping_and_defaults():
    s = sampling_from_proto(vpb.SamplingParams(), room=100, vocab_size=320)
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.repetition_penalty, s.seed, s.logprobs) == \
        (100, 1.0, 1.0, 0, 1.0, None, None)  # vLLM's documented defaults
    assert DEFAULT_TEMPERATURE == 1.0
    s = sampling_from_proto(vpb.SamplingParams(
        temperature=0.5, top_p=0.9, top_k=7, min_p=0.1, frequency_penalty=0.2, presence_penalty=0.3,
        repetition_penalty=1.1, max_tokens=9, stop=["ab"], stop_token_ids=[3], ignore_eos=True, logprobs=1,
        seed=42, include_stop_str_in_output=True, skip_special_tokens=False), room=100, vocab_size=320)
    want = SamplingParams(max_tokens=9, temperature=0.5, top_k=7, top_p=s.top_p, min_p=s.min_p, seed=42,
                          stop=("ab",), stop_token_ids=(3,), ignore_eos=True, repetition_penalty=s.repetition_penalty,
                          presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty, logprobs=1)
    assert s == want
    assert [round(v, 5) for v in (s.top_p, s.min_p, s.presence_penalty, s.frequency_penalty,
                                  s.repetition_penalty)] == [0.9, 0.1, 0.3, 0.2, 1.1]


def test_abort_several_ids_frees_pages(served):
    _st, _engine, stub, _ref, _lp, _ = served
    call = stub.Generate(_req([(3 * j) % 256 for j in range(50)], "to-abort", stream=True, max_tokens=200,
                              ignore_eos=True), timeout=60)
    first = next(call)
    assert first.HasField("chunk")
    stub.Abort(vpb.AbortRequest(request_ids=["no-such-id", "to-abort"]), timeout=10)
    rest = list(call)
    assert rest[-1].complete.finish_reason == "abort"
    assert rest[-1].complete.completion_tokens < 200
    deadline = time.time() + 10
    while True:
        (load,) = stub.GetLoads(vpb.GetLoadsRequest(include=["core"]), timeout=10).loads
        if load.num_used_tokens == 0 or time.time() > deadline:
            break
        time.sleep(0.05)
    assert load.num_used_tokens == 0 and load.token_usage == 0.0 and load.num_running_reqs == 0


def test_info_rpcs(served):
    st, engine, stub, _ref, _lp, _ = served
    info = stub.GetModelInfo(vpb.GetModelInfoRequest(), timeout=10)
    assert info.served_model_name == SERVED_NAME
    # the same name in jaxfill.v1's GetModelInfo and on every metrics series
    from jaxfill.serving.proto.jaxfill.v1 import generation_pb2 as jpb, generation_pb2_grpc as jpb_grpc

    with grpc.insecure_channel(st.address) as ch:
        assert jpb_grpc.GenerationStub(ch).GetModelInfo(jpb.GetModelInfoRequest(), timeout=10).model_name == SERVED_NAME
    assert st.server.metrics.model_name == SERVED_NAME
    assert os.path.isfile(os.path.join(info.model_path, "tokenizer.json"))
    assert info.tokenizer_path == info.model_path
    assert (info.max_context_length, info.vocab_size, info.is_generation) == (256, 320, True)
    assert list(info.eos_token_ids) == [257] and info.bos_token_id == 256
    server = stub.GetServerInfo(vpb.GetServerInfoRequest(), timeout=10)
    assert (server.block_size, server.data_parallel_size, server.max_num_seqs) == (PAGE, 1, 16)
    assert not server.is_paused and server.last_receive_timestamp > 0 and server.kv_connector == ""
    loads = stub.GetLoads(vpb.GetLoadsRequest(include=["core", "memory"]), timeout=10)
    (load,) = loads.loads
    assert loads.dp_rank_count == 1 and load.max_total_num_tokens == 63 * PAGE
    assert load.max_running_requests == 16
    chunks = list(stub.GetTokenizer(cpb.GetTokenizerRequest(), timeout=10))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        with open(os.path.join(info.model_path, "tokenizer.json"), "rb") as f:
            assert z.read("tokenizer.json") == f.read()


def test_served_model_name_default():
    assert served_name(load_config("tiny_random")) == "tiny_random"
    cfg = dataclasses.replace(load_config("tiny_random"), model_path="/models/My-Model/")
    assert served_name(cfg) == "My-Model"


@pytest.mark.slow
def test_serve_cli_served_model_name_and_loopback_default(tmp_path_factory):
    from jaxfill.serving.cli import build_parser

    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"
    sets = [a for k, v in OVERRIDES.items() for a in ("--set", f"{k}={v}")]
    proc = ServeProcess("--served-model-name", "cli-name", *sets, cache_dir=compile_cache_dir(tmp_path_factory))
    try:
        with grpc.insecure_channel(proc.address) as ch:
            stub = vpb_grpc.VllmEngineStub(ch)
            deadline = time.time() + 300
            while not stub.HealthCheck(vpb.HealthCheckRequest(), timeout=10).healthy:
                assert time.time() < deadline, proc.log()
                time.sleep(0.2)
            assert stub.GetModelInfo(vpb.GetModelInfoRequest(), timeout=10).served_model_name == "cli-name"
            (r,) = _run(stub, _req(PROMPTS[2], "cli", max_tokens=3, ignore_eos=True))
            assert r.complete.completion_tokens == 3
    finally:
        proc.kill()


def test_kv_events_store_then_evict(served):
    st, _engine, stub, _ref, _lp, _ = served
    batches: list = []
    call = stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(), timeout=120)
    def read():
        try:
            for b in call:
                batches.append(b)
        except grpc.RpcError as e:  # our own cancel below
            assert e.code() == grpc.StatusCode.CANCELLED

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(0.3)  # the subscription is registered
    ids = [(13 * j + 7) % 256 for j in range(40)]  # 2 full pages
    _run(stub, _req(ids, "kv-1", max_tokens=1))

    def events(kind):
        return [e for b in batches for e in b.events if e.WhichOneof("data") == kind]

    deadline = time.time() + 10
    while len(events("stored")) < 2 and time.time() < deadline:
        time.sleep(0.05)
    stored = [e.stored for e in events("stored")]
    assert [list(s.blocks[0].token_ids) for s in stored[:2]] == [ids[:PAGE], ids[PAGE:2 * PAGE]]
    assert not stored[0].HasField("parent_block_hash")
    assert stored[1].parent_block_hash == stored[0].blocks[0].block_hash
    mine = {s.blocks[0].block_hash for s in stored[:2]}
    # Cycle every page of the pool through other prompts: LRU eviction reaches ours.
    for i in range(6):
        other = [(i * 37 + j * 19 + 1) % 256 for j in range(15 * PAGE)]
        _run(stub, _req(other, f"kv-fill-{i}", max_tokens=1))
    deadline = time.time() + 10
    while not mine <= {h for e in events("removed") for h in e.removed.block_hashes} and time.time() < deadline:
        time.sleep(0.05)
    call.cancel()
    assert mine <= {h for e in events("removed") for h in e.removed.block_hashes}
    seqs = [b.sequence_number for b in batches if not b.load.load_only]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert all(b.load.max_running_requests == 16 for b in batches)


def test_kv_subscription_answers_before_any_cache_change(served):
    """smg takes a KV-event stream that says nothing for 2 s for a dead worker: the first
    message is a load-only record, sent before anything is stored."""
    stub = served[2]
    call = stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(), timeout=30)
    first, second = next(call), next(call)  # the record, then an idle heartbeat
    call.cancel()
    for b in (first, second):
        assert b.load.load_only and not b.events and b.sequence_number == 0
    assert (first.load.sample, second.load.sample) == (0, 1)


def test_zz_unhealthy_while_draining(served):
    """Last: it drains the module's server."""
    st, _engine, stub, _ref, _lp, _ = served
    st.call(st.server.loop.begin_drain)
    h = stub.HealthCheck(vpb.HealthCheckRequest(), timeout=10)
    assert not h.healthy and "draining" in h.message
    assert stub.GetServerInfo(vpb.GetServerInfoRequest(), timeout=10).is_paused
