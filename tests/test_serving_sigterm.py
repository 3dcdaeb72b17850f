"""`jaxfill serve` as a subprocess: health NOT_SERVING -> SERVING after warm-up, API key,
then SIGTERM: NOT_SERVING, new work refused, in-flight finishes, exit 0; a stream
that outlives the grace period is aborted."""

from __future__ import annotations

import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxfill.serving.client import make_request
from jaxfill.serving.proto.jaxfill.v1 import generation_pb2 as pb
from jaxfill.serving.proto.jaxfill.v1 import generation_pb2_grpc as pb_grpc
from serving_util import ServeProcess, compile_cache_dir, scrape

KEY = "s3cret-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _health(stub, service=""):
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


@pytest.mark.slow
def test_serve_lifecycle_health_auth_and_sigterm_drain(tmp_path_factory):
    cache = compile_cache_dir(tmp_path_factory)
    srv = ServeProcess("--metrics-port", "0", "--api-key", KEY, "--grace-period", "60", cache_dir=cache)
    try:
        with grpc.insecure_channel(srv.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            gen = pb_grpc.GenerationStub(ch)
            # Listening before the shape buckets are compiled: NOT_SERVING. (That requests are
            # UNAVAILABLE meanwhile is checked where warm-up can be held: test_serving_admission.)
            seen = [_health(health)]
            deadline = time.time() + 240
            while seen[-1] != SERVING:
                assert srv.proc.poll() is None, srv.log()
                assert time.time() < deadline, srv.log()
                time.sleep(0.05)
                seen.append(_health(health))
            assert seen[0] == NOT_SERVING, f"warm-up ended before the first health check: {srv.log()}"
            assert _health(health, "jaxfill.v1.Generation") == SERVING
            log = srv.log()
            assert "loaded tiny_random" in log and "mesh: data=1" in log and "step buckets" in log, log

            # API key: health needs none; everything else does.
            with pytest.raises(grpc.RpcError) as e:
                list(gen.Generate(make_request([1, 2, 3], max_tokens=2), timeout=10))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as e:
                gen.GetModelInfo(pb.GetModelInfoRequest(), metadata=(("authorization", "Bearer nope"),), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            info = gen.GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH, timeout=10)
            assert info.pages_free == info.pages_total > 0

            # In flight at the signal: 64 tokens finish within the grace period.
            inflight = gen.Generate(make_request([5, 6, 7], max_tokens=64, ignore_eos=True), metadata=AUTH,
                                    timeout=120)
            first_chunk = next(inflight)
            assert first_chunk.HasField("chunk")
            srv.proc.send_signal(signal.SIGTERM)
            deadline = time.time() + 30
            while _health(health) != NOT_SERVING:
                assert time.time() < deadline
                time.sleep(0.01)
            with pytest.raises(grpc.RpcError) as e:
                list(gen.Generate(make_request([1, 2], max_tokens=2), metadata=AUTH, timeout=10))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            rest = list(inflight)
            assert rest[-1].complete.finish_reason == "length"
            assert len(first_chunk.chunk.token_ids) + sum(len(r.chunk.token_ids) for r in rest[:-1]) == 64
        assert srv.proc.wait(60) == 0, srv.log()
        assert "draining" in srv.log() and "stopped" in srv.log()
    finally:
        srv.kill()


@pytest.mark.slow
def test_sigterm_aborts_what_outlives_the_grace_period(tmp_path_factory):
    cache = compile_cache_dir(tmp_path_factory)
    srv = ServeProcess("--grace-period", "0.5", "--metrics-port", "0", cache_dir=cache)
    try:
        with grpc.insecure_channel(srv.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            deadline = time.time() + 240
            while _health(health) != SERVING:
                assert srv.proc.poll() is None and time.time() < deadline, srv.log()
                time.sleep(0.05)
            gen = pb_grpc.GenerationStub(ch)
            long = gen.Generate(make_request([5, 6, 7], max_tokens=3000, ignore_eos=True), timeout=120)
            assert next(long).HasField("chunk")
            assert scrape(srv.metrics_port)[("jaxfill_num_requests_running", (("model_name", "tiny_random"),))] == 1
            srv.proc.send_signal(signal.SIGINT)
            rest = list(long)
            assert rest[-1].complete.finish_reason == "abort"
            assert rest[-1].complete.completion_tokens < 3000
        assert srv.proc.wait(60) == 0, srv.log()
        assert "1 aborted after the grace period" in srv.log(), srv.log()
    finally:
        srv.kill()
