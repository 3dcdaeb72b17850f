"""LoRA over gRPC: jaxfill.v1's `lora` and JetStream's `lora_adapter_id` pick a loaded
adapter per request (the tokens Engine.generate gives, which tests/test_lora.py holds to
transformers + PEFT); an adapter the server has not loaded is INVALID_ARGUMENT naming the
field. smg's vLLM protocol carries no adapter field to wire."""

import grpc
import pytest

from lora_adapters import make_family
from test_lora import ENGINE, LORA, TOKENS, prompt
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
from jaxfill.serving.client import make_request
from jaxfill.serving.proto.jaxfill.v1 import generation_pb2 as pb
from jaxfill.serving.proto.jaxfill.v1 import generation_pb2_grpc as pb_grpc
from jaxfill.serving.proto.jetstream.core.proto import jetstream_pb2 as js
from jaxfill.serving.proto.jetstream.core.proto import jetstream_pb2_grpc as js_grpc
from jaxfill.serving.server import ServerThread


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    base, dirs = make_family(str(tmp_path_factory.mktemp("lora")), "llama", ("A", "B"))
    engine = Engine.from_config(model_path=base, overrides={**ENGINE, **LORA}, progress=False)
    for name, path in dirs.items():
        engine.load_lora(name, path)
    engine.dirs = dirs  # for the admin calls' test
    ids = prompt(12, 7)
    want = {name: engine.generate([ids], SamplingParams(max_tokens=TOKENS, ignore_eos=True, lora=name))[0].token_ids
            for name in ("A", "B", None)}
    assert len({tuple(t) for t in want.values()}) == 3  # each adapter changes the tokens
    with ServerThread(engine, host="127.0.0.1", port=0) as st:
        assert st.wait_ready(600), "server never became ready"
        yield st, ids, want, engine


def _generate(stub, ids, lora):
    out = []
    for resp in stub.Generate(make_request(ids, lora=lora, max_tokens=TOKENS, ignore_eos=True), timeout=60):
        if resp.WhichOneof("response") == "chunk":
            out.extend(resp.chunk.token_ids)
    return out


def _decode(stub, ids, lora):
    req = js.DecodeRequest(max_tokens=TOKENS, has_bos=True, lora_adapter_id=lora,
                           token_content=js.DecodeRequest.TokenContent(token_ids=ids))
    return [t for resp in stub.Decode(req, timeout=60) for s in resp.stream_content.samples for t in s.token_ids]


def test_adapters_are_picked_per_request_over_grpc(served):
    st, ids, want, _ = served
    with grpc.insecure_channel(st.address) as ch:
        stub, jstub = pb_grpc.GenerationStub(ch), js_grpc.OrchestratorStub(ch)
        for name in ("A", "B", None):
            assert _generate(stub, ids, name or "") == want[name], name
        assert _decode(jstub, ids, "B") == want["B"]
        for fn, field in ((lambda: _generate(stub, ids, "nope"), "lora"),
                          (lambda: _decode(jstub, ids, "nope"), "lora_adapter_id")):
            with pytest.raises(grpc.RpcError) as e:
                fn()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith(f"{field}: unknown adapter 'nope'"), e.value.details()


def test_adapters_are_loaded_and_unloaded_over_grpc(served):
    """LoadLora / UnloadLora / ListLoras: an adapter loaded at run time serves requests; a
    bad directory is INVALID_ARGUMENT, an unknown name to unload NOT_FOUND."""
    st, ids, want, engine = served
    with grpc.insecure_channel(st.address) as ch:
        stub = pb_grpc.GenerationStub(ch)
        names = lambda r: sorted(a.name for a in r.adapters)  # noqa: E731
        assert names(stub.ListLoras(pb.ListLorasRequest(), timeout=30)) == ["A", "B"]
        loaded = stub.LoadLora(pb.LoadLoraRequest(name="late", path=engine.dirs["B"]), timeout=30)
        assert names(loaded) == ["A", "B", "late"]
        assert _generate(stub, ids, "late") == want["B"]
        assert names(stub.UnloadLora(pb.UnloadLoraRequest(name="late"), timeout=30)) == ["A", "B"]
        for fn, code, start in (
                (lambda: stub.LoadLora(pb.LoadLoraRequest(name="x", path="/nonexistent"), timeout=30),
                 grpc.StatusCode.INVALID_ARGUMENT, "path: /nonexistent: no adapter_config.json"),
                (lambda: stub.LoadLora(pb.LoadLoraRequest(name="A", path=engine.dirs["A"]), timeout=30),
                 grpc.StatusCode.INVALID_ARGUMENT, "lora: adapter 'A' is already loaded"),
                (lambda: stub.UnloadLora(pb.UnloadLoraRequest(name="late"), timeout=30),
                 grpc.StatusCode.NOT_FOUND, "name: no adapter 'late'")):
            with pytest.raises(grpc.RpcError) as e:
                fn()
            assert e.value.code() == code and e.value.details().startswith(start), e.value.details()
