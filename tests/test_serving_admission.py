"""A small in-process server whose warm-up and steps the test holds back: UNAVAILABLE while
warming (never "no answer"), `jaxfill client --wait-ready`, overload admission (batch
slots first, then engine.max_waiting), and ServerThread as a context manager."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import threading

import grpc
import pytest

from jaxfill.engine.config import load_config
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
from jaxfill.serving import cli
from jaxfill.serving.client import AsyncClient, Client, make_request
from jaxfill.serving.engine_loop import STOPPED
from jaxfill.serving.proto.jaxfill.v1 import generation_pb2_grpc as pb_grpc
from jaxfill.serving.proto.jetstream.core.proto import jetstream_pb2 as js
from jaxfill.serving.proto.jetstream.core.proto import jetstream_pb2_grpc as js_grpc
from jaxfill.serving.server import ServerThread
from serving_util import compile_cache_dir
from fast_engine import REFERENCE_ATTENTION

SLOTS, MAX_WAITING = 16, 8
OVERRIDES = {**REFERENCE_ATTENTION,  # tests/fast_engine.py
             "engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64], "engine.num_pages": 64,
             "engine.max_model_len": 256, "engine.max_num_seqs": SLOTS, "engine.max_waiting": MAX_WAITING}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    compile_cache_dir(tmp_path_factory)
    overrides = [f"{k}={v}" for k, v in OVERRIDES.items()]
    return Engine(load_config("tiny_random", overrides), progress=False, warmup=False)


@contextlib.contextmanager
def _held(obj, name: str):
    """Replaces obj.name by a version that waits for the yielded Event first."""
    gate = threading.Event()
    real = getattr(obj, name)

    def held(*args, **kwargs):
        assert gate.wait(120), f"{name} held too long"
        return real(*args, **kwargs)

    setattr(obj, name, held)
    try:
        yield gate
    finally:
        gate.set()
        delattr(obj, name)


@pytest.mark.slow
def test_warming_server_refuses_with_unavailable_and_client_waits_for_ready(engine):
    assert not engine.warmed_up  # the first test here: warm-up really runs behind the gate
    with _held(engine, "warmup") as gate, ServerThread(engine, host="127.0.0.1", port=0) as st:
        with grpc.insecure_channel(st.address) as ch:
            with pytest.raises(grpc.RpcError) as e:
                list(pb_grpc.GenerationStub(ch).Generate(make_request([1, 2, 3], max_tokens=2), timeout=30))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "warming up" in e.value.details()
            decode = js.DecodeRequest(max_tokens=2, token_content=js.DecodeRequest.TokenContent(token_ids=[1]))
            with pytest.raises(grpc.RpcError) as e:
                list(js_grpc.OrchestratorStub(ch).Decode(decode, timeout=30))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        with Client(st.address) as c:
            with pytest.raises(TimeoutError):
                c.wait_serving(0.3)
        # `jaxfill client --wait-ready` blocks on health until warm-up ends, then gets its tokens.
        argv = ["client", "--address", st.address, "--prompt-ids", "5,6,7", "--max-tokens", "3",
                "--ignore-eos", "--json", "--wait-ready", "120"]
        out, rc = io.StringIO(), []
        with contextlib.redirect_stdout(out):
            t = threading.Thread(target=lambda: rc.append(cli.main(argv)))
            t.start()
            t.join(1.0)
            assert t.is_alive(), "the client did not wait for warm-up"
            gate.set()
            t.join(120)
        assert rc == [0], out.getvalue()
        assert '"finish_reason": "length"' in out.getvalue() and '"completion_tokens": 3' in out.getvalue()
        row = json.loads(out.getvalue().strip().splitlines()[-1])
        assert isinstance(row["text"], str) and len(row["token_ids"]) == 3  # --json carries the text too
    assert engine.warmed_up


def test_client_wait_ready_times_out_with_a_clear_error(capsys):
    from serving_util import free_port

    rc = cli.main(["client", "--address", f"127.0.0.1:{free_port()}", "--wait-ready", "0.3"])
    assert rc == 1
    assert "not SERVING after 0.3 s" in capsys.readouterr().err


def test_burst_fills_free_batch_slots_then_the_waiting_places(engine):
    """60 requests at once while the engine thread is held before its first step: the
    server admits exactly SLOTS + MAX_WAITING = 24 (all slots were free), refuses the other
    36 with RESOURCE_EXHAUSTED, and every admitted request completes once steps run."""
    n = 60
    with _held(engine, "step") as gate, ServerThread(engine, host="127.0.0.1", port=0) as st:
        assert st.wait_ready(300)

        async def go():
            async with AsyncClient(st.address) as c:
                async def one(i):
                    try:
                        return await c.generate([1 + i % 200, 2, 3], max_tokens=4, ignore_eos=True, timeout=120)
                    except grpc.aio.AioRpcError as e:
                        return e

                tasks = [asyncio.create_task(one(i)) for i in range(n)]
                refused = []
                while len(refused) < n - SLOTS - MAX_WAITING:  # the refusals come back while steps are held
                    done, _ = await asyncio.wait(tasks, timeout=60, return_when=asyncio.FIRST_COMPLETED)
                    assert done, "no answer while the engine was held"
                    refused = [t for t in tasks if t.done()]
                assert st.server.loop.num_active == SLOTS + MAX_WAITING
                gate.set()
                return await asyncio.gather(*tasks)

        results = asyncio.run(asyncio.wait_for(go(), 180))
    errors = [r for r in results if isinstance(r, Exception)]
    done = [r for r in results if not isinstance(r, Exception)]
    assert len(done) == SLOTS + MAX_WAITING and len(errors) == n - SLOTS - MAX_WAITING
    assert {e.code() for e in errors} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert "16 batch slots and 8 waiting places" in errors[0].details()
    assert all(r.finish_reason == "length" and len(r.token_ids) == 4 for r in done)


def test_server_thread_context_manager_closes_its_loop(engine):
    with ServerThread(engine, host="127.0.0.1", port=0) as st:
        assert st.wait_ready(300)
        with Client(st.address) as c:
            assert len(c.generate([4, 5, 6], max_tokens=2, ignore_eos=True, timeout=60).token_ids) == 2
        loop, thread = st.event_loop, st.thread
    assert loop.is_closed() and not thread.is_alive()
    assert st.server.loop.state == STOPPED
    assert st.stop() == {"in_flight": 0, "aborted": 0}  # idempotent
    # The engine is free again for a plain generate() in this thread.
    assert len(engine.generate([[4, 5, 6]], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids) == 2
