"""Two `jaxfill serve` processes, --role prefill and --role decode, driven with the vLLM stubs
the way smg's PD router drives them (serving/disagg.py): the prefill leg with max_tokens=1,
ignore_eos, not streaming and {"do_remote_decode": true}; the decode leg with the original
request and the returned JSON merged with {"do_remote_prefill": true}. A `both` worker
(the same config) is the reference."""

import json
import time

import grpc
import pytest
from serving_util import ServeProcess, compile_cache_dir
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc
from fast_engine import REFERENCE_ATTENTION

OVERRIDES = {**REFERENCE_ATTENTION,  # tests/fast_engine.py
             "engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64], "engine.num_pages": 64,
             "engine.max_model_len": 256, "engine.max_num_seqs": 4}
PROMPTS = [[(i * 31 + j * 17) % 256 for j in range(n)] for i, n in enumerate([1, 5, 17, 40, 100])]
NIXL_PREFILL = '{"do_remote_decode":true,"do_remote_prefill":false}'


def _sets(**extra):
    return [a for k, v in {**OVERRIDES, **extra}.items() for a in ("--set", f"{k}={v}")]


def _stub(proc):
    ch = grpc.insecure_channel(proc.address)
    stub = vpb_grpc.VllmEngineStub(ch)
    deadline = time.time() + 300
    while not stub.HealthCheck(vpb.HealthCheckRequest(), timeout=10).healthy:
        assert time.time() < deadline, proc.log()
        time.sleep(0.2)
    return stub


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    cache = compile_cache_dir(tmp_path_factory)
    procs = {
        "prefill": ServeProcess("--role", "prefill", *_sets(**{"engine.kv_transfer_timeout_s": 5}), cache_dir=cache),
        "decode": ServeProcess("--role", "decode", *_sets(**{"engine.page_size": 8, "engine.kv_transfer_timeout_s": 3}),
                                cache_dir=cache),
        "both": ServeProcess(*_sets(**{"engine.page_size": 8}), cache_dir=cache),
    }
    try:
        yield {k: (p, _stub(p)) for k, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()


def _req(ids, rid, stream=False, kv=None, **sp):
    sp.setdefault("temperature", 0.0)
    req = vpb.GenerateRequest(request_id=rid, tokenized=vpb.TokenizedInput(input_ids=ids),
                              sampling_params=vpb.SamplingParams(**sp), stream=stream)
    if kv is not None:
        req.kv_transfer_params_json = kv
    return req


def _prefill_leg(stub, ids, rid, **sp):
    sp = {**sp, "max_tokens": 1, "ignore_eos": True}
    (resp,) = list(stub.Generate(_req(ids, rid, kv=NIXL_PREFILL, **sp), timeout=60))
    params = json.loads(resp.complete.kv_transfer_params_json)
    params["do_remote_prefill"] = True  # smg merges it in
    return json.dumps(params)


def _pages(stub):
    load = stub.GetLoads(vpb.GetLoadsRequest(), timeout=10).loads[0]
    return load.num_used_tokens


def _wait_free(stub, timeout=10.0):
    deadline = time.time() + timeout
    while _pages(stub) != 0:
        assert time.time() < deadline, f"{_pages(stub)} tokens' pages still used"
        time.sleep(0.05)


@pytest.mark.slow
def test_server_info_names_roles(workers):
    infos = {k: s.GetServerInfo(vpb.GetServerInfoRequest(), timeout=10) for k, (_, s) in workers.items()}
    assert (infos["prefill"].kv_connector, infos["prefill"].kv_role) == ("NixlConnector", "kv_producer")
    assert (infos["decode"].kv_connector, infos["decode"].kv_role) == ("NixlConnector", "kv_consumer")
    assert infos["both"].kv_connector == ""


@pytest.mark.parametrize("i,sp,stream", [
    (3, dict(max_tokens=8), False),
    (4, dict(max_tokens=8, temperature=0.8, seed=5, logprobs=1), True),
    (0, dict(max_tokens=4), False),  # a one-token prompt: nothing to move
    (2, dict(max_tokens=6, temperature=1.0, seed=9), True),
], ids=["greedy", "seeded-stream", "one-token", "seeded-17"])
def test_pd_tokens_equal_one_worker(workers, i, sp, stream):
    (_, pre), (_, dec), (_, both) = workers["prefill"], workers["decode"], workers["both"]
    ids = PROMPTS[i]
    want = list(both.Generate(_req(ids, f"ref{i}", stream=stream, **sp), timeout=60))[-1].complete
    kv = _prefill_leg(pre, ids, f"pd{i}", **sp)
    out = list(dec.Generate(_req(ids, f"pd{i}", stream=stream, kv=kv, **sp), timeout=60))
    got = out[-1].complete
    assert list(got.output_ids) == list(want.output_ids)
    assert (got.finish_reason, got.prompt_tokens, got.completion_tokens) == \
        (want.finish_reason, want.prompt_tokens, want.completion_tokens)
    if stream:
        assert [t for r in out[:-1] for t in r.chunk.token_ids] == list(want.output_ids)
    _wait_free(dec)
    _wait_free(pre, timeout=1.5)  # released by the decode side at once, not by the 5 s timeout


def test_mooncake_params_and_a_pinned_rank_are_accepted(workers):
    """What smg may add: Mooncake-style kv_transfer_params (host and port only) beside the
    JSON leave the hand-off as it is; alone they hand nothing over, so the decode worker
    computes the prompt itself; data_parallel_rank 0 of a one-replica worker is served."""
    (_, pre), (_, dec), (_, both) = workers["prefill"], workers["decode"], workers["both"]
    ids, sp = PROMPTS[3], dict(max_tokens=6)
    want = list(both.Generate(_req(ids, "mc-ref", **sp), timeout=60))[-1].complete.output_ids
    mooncake = vpb.KvTransferParams(remote_host="127.0.0.1", remote_port=1)
    kv = _prefill_leg(pre, ids, "mc1")
    req = _req(ids, "mc1", kv=kv, **sp)
    req.kv_transfer_params.CopyFrom(mooncake)
    req.data_parallel_rank = 0
    assert list(list(dec.Generate(req, timeout=60))[-1].complete.output_ids) == list(want)
    _wait_free(pre, timeout=1.5)  # pulled and released: the JSON offer was used
    alone = _req(ids, "mc2", **sp)
    alone.kv_transfer_params.CopyFrom(mooncake)
    assert list(list(dec.Generate(alone, timeout=60))[-1].complete.output_ids) == list(want)
    _wait_free(dec)


def test_pull_that_never_comes_frees_after_timeout(workers):
    (_, pre), (_, dec) = workers["prefill"], workers["decode"]
    kv = _prefill_leg(pre, PROMPTS[4], "orphan")
    assert _pages(pre) > 0  # held for a decode leg that never comes
    _wait_free(pre, timeout=10.0)  # engine.kv_transfer_timeout_s = 5
    # The decode leg arriving now finds nothing to pull: a clear status, nothing held.
    with pytest.raises(grpc.RpcError) as e:
        list(dec.Generate(_req(PROMPTS[4], "orphan", kv=kv, max_tokens=4), timeout=60))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "timed out" in e.value.details()
    assert _pages(dec) == 0


def test_wrong_role_and_bad_params_are_refused(workers):
    (_, pre), (_, dec) = workers["prefill"], workers["decode"]
    for stub, kv in [(dec, NIXL_PREFILL), (pre, '{"do_remote_prefill": true}'), (dec, "not json")]:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(_req(PROMPTS[2], "bad", kv=kv, max_tokens=2), timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("kv_transfer_params_json:"), e.value.details()


def test_held_kv_is_bounded_by_a_share_of_the_pool(workers):
    """Prefill legs whose decode leg never pulls: past engine.kv_transfer_max_held_share
    (0.5 here) of the pool, the next one is refused with RESOURCE_EXHAUSTED, and the pool
    comes back once the held pages time out."""
    (_, pre) = workers["prefill"]
    _wait_free(pre, timeout=15.0)
    long = list(range(3, 3 + 60))  # 60 tokens: 4 pages of 16 each
    held, refused = 0, None
    for i in range(40):
        try:
            _prefill_leg(pre, long[i % 5:] + [i], f"hog-{i}")
            held += 1
        except grpc.RpcError as e:
            refused = e
            break
    assert refused is not None and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
    assert "kv_transfer_max_held_share" in refused.details() and held >= 1
    assert _pages(pre) > 0
    _wait_free(pre, timeout=15.0)  # engine.kv_transfer_timeout_s = 5
