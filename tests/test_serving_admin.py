"""jaxfill.v1.EngineAdmin over gRPC: UpdateWeights, Sleep, WakeUp, IsSleeping on a
serving engine, run on its engine thread between steps. A sleeping server answers
Generate with UNAVAILABLE and keeps running; after WakeUp it serves the same tokens."""

import grpc
import pytest

from fast_engine import REFERENCE_ATTENTION
from jaxfill import Engine, SamplingParams
from jaxfill.engine.config import load_config
from jaxfill.serving.proto.jaxfill.v1 import engine_admin_pb2 as apb
from jaxfill.serving.proto.jaxfill.v1 import engine_admin_pb2_grpc as apb_grpc
from jaxfill.serving.proto.jaxfill.v1 import generation_pb2 as pb
from jaxfill.serving.proto.jaxfill.v1 import generation_pb2_grpc as pb_grpc
from jaxfill.serving.server import ServerThread

OVER = {**REFERENCE_ATTENTION, "engine.max_model_len": 256, "engine.num_pages": 64, "engine.max_num_seqs": 4,
        "engine.max_num_batched_tokens": 32, "engine.token_buckets": [32]}
PROMPT = list(range(5, 38))
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from hf_models import make_hf_checkpoint

    root = tmp_path_factory.mktemp("admin")
    paths = [make_hf_checkpoint(str(root / f"seed{s}"), "llama", seed=s) for s in (0, 1)]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    other = Engine(load_config("tiny_random", OVER, paths[1]), progress=False, warmup=False)
    ref_b = other.generate([PROMPT], greedy)[0].token_ids
    del other
    engine = Engine(load_config("tiny_random", OVER, paths[0]), progress=False, warmup=False)
    ref_a = engine.generate([PROMPT], greedy)[0].token_ids
    with ServerThread(engine, host="127.0.0.1", port=0) as st:
        assert st.wait_ready(300), "server never became ready"
        with grpc.insecure_channel(st.address) as ch:
            yield engine, paths, (ref_a, ref_b), pb_grpc.GenerationStub(ch), apb_grpc.EngineAdminStub(ch)


def generate(stub) -> list[int]:
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT),
                             sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return [t for r in stub.Generate(req, timeout=60) if r.HasField("chunk") for t in r.chunk.token_ids]


def test_update_weights_over_grpc(served):
    engine, paths, (ref_a, ref_b), gen, admin = served
    assert generate(gen) == ref_a and ref_a != ref_b
    programs = engine.stats()["compiled_programs"]
    out = admin.UpdateWeights(apb.UpdateWeightsRequest(path=paths[1]), timeout=60)
    assert out.params_replaced > 0 and out.freed_bytes == engine.stats()["weight_bytes"]
    assert generate(gen) == ref_b
    with pytest.raises(grpc.RpcError) as e:
        admin.UpdateWeights(apb.UpdateWeightsRequest(path=paths[1] + "-missing"), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a checkpoint directory" in e.value.details()
    assert generate(gen) == ref_b
    admin.UpdateWeights(apb.UpdateWeightsRequest(path=paths[0], abort_in_flight=True), timeout=60)
    assert generate(gen) == ref_a
    assert engine.stats()["compiled_programs"] == programs


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_over_grpc(served, level):
    engine, _, (ref_a, _), gen, admin = served
    st = engine.stats()
    want = st["kv_cache_bytes"] + (st["weight_bytes"] if level == 2 else 0)
    assert admin.Sleep(apb.SleepRequest(level=level), timeout=60).freed_bytes == want
    state = admin.IsSleeping(apb.IsSleepingRequest(), timeout=10)
    assert state.sleeping and state.level == level and state.device_bytes == st["device_bytes"] - want
    with pytest.raises(grpc.RpcError) as e:
        generate(gen)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "engine sleeps" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        admin.Sleep(apb.SleepRequest(level=2), timeout=60)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert gen.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).vocab_size > 0  # the server keeps running
    assert admin.WakeUp(apb.WakeUpRequest(), timeout=60).placed_bytes == want
    assert not admin.IsSleeping(apb.IsSleepingRequest(), timeout=10).sleeping
    assert generate(gen) == ref_a
