"""An exception no servicer expected (a bug on our side) becomes an INTERNAL status with the
method and the error in its message, and one log line with the traceback; the server goes on
serving that RPC and every other one (serving/interceptors.py).

The PD soak that found the stats() race (tests/test_stats_threads.py) saw a bare traceback
and grpc's UNKNOWN instead."""

from __future__ import annotations

import logging

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from jaxfill.engine.config import load_config
from jaxfill.engine.engine import Engine
from jaxfill.serving.server import ServerThread
from serving_util import compile_cache_dir
from fast_engine import REFERENCE_ATTENTION

OVERRIDES = {**REFERENCE_ATTENTION,  # tests/fast_engine.py
             "engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64], "engine.num_pages": 64,
             "engine.max_model_len": 256}


def _req(rid: str, **kw) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(request_id=rid, tokenized=vpb.TokenizedInput(input_ids=[5, 6, 7]),
                               sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=3), **kw)


class Boom(RuntimeError):
    pass


@pytest.mark.slow
def test_unexpected_exceptions_answer_internal_and_the_server_goes_on(tmp_path_factory, caplog, monkeypatch):
    compile_cache_dir(tmp_path_factory)
    engine = Engine(load_config("tiny_random", OVERRIDES), progress=False)
    with ServerThread(engine, host="127.0.0.1", port=0) as st:
        assert st.wait_ready(600)
        servicer = st.server.vllm
        fail = {"unary": True, "stream": True}
        real_load, real_parse = servicer._load, servicer.disagg.parse

        def flaky_load():
            if fail["unary"]:
                raise Boom("array deleted (unary)")
            return real_load()

        def flaky_parse(request):
            if fail["stream"] and request.request_id == "bad":
                raise Boom("array deleted (stream)")
            return real_parse(request)

        monkeypatch.setattr(servicer, "_load", flaky_load)
        monkeypatch.setattr(servicer.disagg, "parse", flaky_parse)
        caplog.set_level(logging.ERROR, logger="jaxfill.serving")
        with grpc.insecure_channel(st.address) as ch:
            stub = vpb_grpc.VllmEngineStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                stub.GetLoads(vpb.GetLoadsRequest(), timeout=30)
            assert e.value.code() == grpc.StatusCode.INTERNAL
            assert "GetLoads" in e.value.details() and "Boom: array deleted (unary)" in e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(_req("bad", stream=True), timeout=30))
            assert e.value.code() == grpc.StatusCode.INTERNAL
            assert "Generate" in e.value.details() and "array deleted (stream)" in e.value.details()
            # aborts a servicer means keep their own status
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(vpb.GenerateRequest(request_id="empty", sampling_params=vpb.SamplingParams(
                    max_tokens=3)), timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # the server goes on: the same RPCs now succeed, other requests were never hurt
            fail.update(unary=False, stream=False)
            assert stub.GetLoads(vpb.GetLoadsRequest(), timeout=30).loads
            out = list(stub.Generate(_req("good"), timeout=60))
            assert out[-1].complete.finish_reason == "length" and len(out[-1].complete.output_ids) == 3
        logged = [r for r in caplog.records if "failed: Boom" in r.getMessage()]
        assert len(logged) == 2 and all(r.exc_info for r in logged)
        assert engine.stats()["pages_free"] == engine.stats()["pages_total"]
