"""vllm.grpc.engine.VllmEngine/Embed on a real server on 127.0.0.1 (what smg's /v1/embeddings
calls): the vectors equal Engine.embed's on the same engine, alone and while a Generate runs
in the same steps; bad inputs are INVALID_ARGUMENT naming the field, an engine without
model.pooling is FAILED_PRECONDITION naming it, a failure inside the engine thread or the
handler is INTERNAL; every page is back after each, failed ones included."""

from __future__ import annotations

import concurrent.futures
import logging
import time

import grpc
import numpy as np
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from embed_refs import write_st_modules
from fast_engine import REFERENCE_ATTENTION
from hf_models import make_hf_checkpoint
from jaxfill.engine.config import load_config
from jaxfill.engine.engine import Engine
from jaxfill.serving.server import ServerThread
from serving_util import compile_cache_dir

SETTINGS = {**REFERENCE_ATTENTION, "engine.num_pages": 40, "engine.max_model_len": 64, "engine.max_num_seqs": 4,
            "engine.max_num_batched_tokens": 64, "engine.token_buckets": [64], "mesh.cpu_split": False}
PROMPTS = [list(np.random.default_rng(n).integers(3, 500, n)) for n in (1, 5, 23, 40)]


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def embed_req(ids, rid: str = "") -> vpb.EmbedRequest:
    return vpb.EmbedRequest(request_id=rid, tokenized=vpb.TokenizedInput(input_ids=[int(t) for t in ids]))


def pages_all_back(stub) -> bool:
    load = stub.GetLoads(vpb.GetLoadsRequest(), timeout=10).loads[0]
    return load.num_used_tokens == 0 and load.num_running_reqs == 0 and load.num_waiting_reqs == 0


def settled(stub) -> bool:
    """Pages all back within 5 s (a refused request's pages go back before the next step)."""
    for _ in range(50):
        if pages_all_back(stub):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, stub, engine, reference vectors): last-token pooling, normalized (Qwen3-Embedding's)."""
    compile_cache_dir(tmp_path_factory)
    ckpt = make_hf_checkpoint(str(tmp_path_factory.mktemp("qwen3")), "qwen3")
    write_st_modules(ckpt, "last", True, hidden=64)
    engine = Engine.from_config("tiny", model_path=ckpt, overrides=SETTINGS, progress=False)
    ref = engine.embed(PROMPTS)
    with ServerThread(engine, host="127.0.0.1", port=0) as st:
        assert st.wait_ready(300)
        with grpc.insecure_channel(st.address) as ch:
            yield st, vpb_grpc.VllmEngineStub(ch), engine, ref


def test_embed_equals_engine_embed(served):
    _st, stub, _engine, ref = served
    for i, (ids, want) in enumerate(zip(PROMPTS, ref)):
        got = stub.Embed(embed_req(ids, f"e{i}"), timeout=60)
        assert got.prompt_tokens == len(ids) and got.embedding_dim == 64 == len(got.embedding)
        assert cosine(got.embedding, want) > 1 - 1e-5
        np.testing.assert_allclose(got.embedding, want, atol=1e-5)
    assert pages_all_back(stub)


def test_concurrent_embeds_and_a_generate_share_steps(served):
    _st, stub, _engine, ref = served
    gen = vpb.GenerateRequest(request_id="g", tokenized=vpb.TokenizedInput(input_ids=[5, 6, 7]),
                              sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        done = pool.submit(lambda: list(stub.Generate(gen, timeout=60)))
        futures = [pool.submit(stub.Embed, embed_req(ids), timeout=60) for ids in PROMPTS]
        got = [f.result() for f in futures]
        assert len(done.result()[-1].complete.output_ids) == 8
    for g, want in zip(got, ref):
        assert cosine(g.embedding, want) > 1 - 1e-5
    assert pages_all_back(stub)


@pytest.mark.parametrize("request_,field,says", [
    (vpb.EmbedRequest(request_id="no-input"), "tokenized.input_ids", "empty"),
    (embed_req([], "no-ids"), "tokenized.input_ids", "empty"),
    (embed_req([1, 2, 512], "oov"), "tokenized.input_ids", "outside the vocabulary"),
    (embed_req([1] * 64, "long"), "tokenized.input_ids", "max_model_len"),
    (embed_req([1], "x" * 300), "request_id", "longer"),
], ids=["no-input", "no-ids", "out-of-vocab", "too-long", "long-id"])
def test_bad_input_is_invalid_argument(served, request_, field, says):
    _st, stub, _engine, ref = served
    with pytest.raises(grpc.RpcError) as e:
        stub.Embed(request_, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(field) and says in e.value.details(), e.value.details()
    assert pages_all_back(stub)
    assert cosine(stub.Embed(embed_req(PROMPTS[1]), timeout=60).embedding, ref[1]) > 1 - 1e-5


def test_a_failure_in_the_engine_thread_is_internal_and_frees_pages(served, monkeypatch, caplog):
    _st, stub, engine, ref = served
    def fail(ids, pooling, request_id=None):
        raise RuntimeError("injected add failure")

    monkeypatch.setattr(engine, "add_pooling_request", fail)
    with caplog.at_level(logging.ERROR, logger="jaxfill.serving"):
        with pytest.raises(grpc.RpcError) as e:
            stub.Embed(embed_req(PROMPTS[2], "boom"), timeout=30)
    monkeypatch.undo()
    assert e.value.code() == grpc.StatusCode.INTERNAL and "injected add failure" in e.value.details()
    assert "injected add failure" in caplog.text
    assert settled(stub)
    assert cosine(stub.Embed(embed_req(PROMPTS[2]), timeout=60).embedding, ref[2]) > 1 - 1e-5


def test_an_unexpected_handler_error_is_internal_and_logged(served, monkeypatch, caplog):
    st, stub, _engine, _ref = served

    def broken(*a, **k):
        raise KeyError("injected handler bug")

    monkeypatch.setattr(st.server.core.loop, "submit_pooling", broken)
    with caplog.at_level(logging.ERROR, logger="jaxfill.serving"):
        with pytest.raises(grpc.RpcError) as e:
            stub.Embed(embed_req(PROMPTS[0]), timeout=30)
    assert e.value.code() == grpc.StatusCode.INTERNAL and "injected handler bug" in e.value.details()
    assert "Embed failed" in caplog.text
    assert pages_all_back(stub)


def test_an_engine_without_pooling_says_model_pooling(tmp_path_factory):
    compile_cache_dir(tmp_path_factory)
    overrides = {**SETTINGS, "engine.token_buckets": [16], "engine.max_num_batched_tokens": 16}
    engine = Engine(load_config("tiny_random", overrides), progress=False, warmup=False)
    with ServerThread(engine, host="127.0.0.1", port=0) as st:
        assert st.wait_ready(300)
        with grpc.insecure_channel(st.address) as ch:
            stub = vpb_grpc.VllmEngineStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                stub.Embed(embed_req([1, 2, 3]), timeout=30)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "model.pooling" in e.value.details(), e.value.details()
            assert pages_all_back(stub)
