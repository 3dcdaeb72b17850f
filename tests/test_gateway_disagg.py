"""Disaggregated prefill/decode behind the real `smg` gateway (issue 13), loopback only:
`jaxfill serve --role prefill` + `--role decode` behind `smg launch --pd-disaggregation`,
checked against one `--role both` worker started the same way behind a plain smg.

What smg 1.13 does in PD mode (measured with plain workers, /work/shared/NOTES.md):
* it registers any vLLM-protocol worker as prefill or decode (no role check);
* only when the prefill worker's GetServerInfo reports kv_connector "NixlConnector" does
  it tag the prefill leg (max_tokens=1, kv_transfer_params_json={"do_remote_decode":
  true, ...}) and relay the returned kv_transfer_params_json to the decode leg; without
  it the decode worker silently recomputes the whole prompt (right tokens, no transfer),
  so the tests also check smg's log for its two fallback warnings ("no kv_connector
  detected", "prefill returned no kv_transfer_params");
* the prefill leg must answer within --worker-wedge-secs (default 3 s, too short for a
  first request on a loaded 2-core machine), hence SMG_FLAGS.

Every process is killed at the end, even on failure."""

from __future__ import annotations

import threading

import grpc
import pytest

from gateway_util import WORKER_SETTINGS, SmgProcess, kill_all, smg_binary, start_worker, wait_until, worker_load
from serving_util import ServeProcess, compile_cache_dir, free_port, scrape

import openai  # the test extra installs it, and smg: missing is a failure, never a skip
from xla_flags import fake_devices

assert smg_binary(), "the smg gateway binary is not on PATH: pip install -e '.[test]'"

SMG_FLAGS = ["--worker-wedge-secs", "30", "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
             "--health-success-threshold", "1", "--retry-max-retries", "2", "--retry-initial-backoff-ms", "200",
             "--retry-max-backoff-ms", "500"]
TWO_FAKE_DEVICES = {"XLA_FLAGS": fake_devices(2)}

VERSE = ("ROMEO:\nBut, soft! what light through yonder window breaks? It is the east, and Juliet is the sun. "
         "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief.\n")
SHARED = "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo? Deny thy father and refuse thy name.\n"


# Generous bounds: a loaded CI machine is slow, and a bound only matters when something hangs.
WAIT_S = 90


def workload() -> list[dict]:
    """20 requests: prompts of 4 to ~200 tokens, greedy and seeded, some streaming, some with
    a stop string, four sharing a 3-page prefix (cached_tokens > 0 on the later ones)."""
    out = []
    for i in range(20):
        if i % 5 == 4:
            prompt = SHARED + f"Reply {i}:"
        else:
            n = [4, 17, 60, 120, 190][i % 5]
            prompt = (VERSE * 3)[i: i + n]
        req = {"prompt": prompt, "max_tokens": [8, 24, 40, 16][i % 4], "stream": i % 3 == 0}
        if i % 2:
            req.update(temperature=0.9, seed=1000 + i)
        else:
            req.update(temperature=0.0)
        if i % 7 == 3:
            req["stop"] = ["\n"]
        out.append(req)
    return out


def complete(client, model: str, req: dict) -> dict:
    """One completion (plain or streaming): text, finish reason and usage as the client sees them."""
    kwargs = {k: v for k, v in req.items() if k != "stream"}
    if not req["stream"]:
        r = client.completions.create(model=model, **kwargs)
        u = r.usage
        cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
        return {"text": r.choices[0].text, "finish": r.choices[0].finish_reason,
                "usage": (u.prompt_tokens, u.completion_tokens, cached)}
    text, finish, u = [], None, None
    for chunk in client.completions.create(model=model, stream=True, stream_options={"include_usage": True},
                                           **kwargs):
        for ch in chunk.choices:
            text.append(ch.text)
            finish = ch.finish_reason or finish
        u = chunk.usage or u
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    return {"text": "".join(text), "finish": finish, "usage": (u.prompt_tokens, u.completion_tokens, cached)}


def counter(worker, name: str, **labels) -> float:
    return sum(v for (n, ls), v in scrape(worker.metrics_port).items()
               if n == name and all(dict(ls).get(k) == want for k, want in labels.items()))


def server_info(worker):
    from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

    with grpc.insecure_channel(worker.address) as channel:
        return vpb_grpc.VllmEngineStub(channel).GetServerInfo(vpb.GetServerInfoRequest(), timeout=10)


def assert_kv_relayed(gateway):
    """smg took the NIXL-style relay (prefill tagged, its kv_transfer_params passed to decode)
    and never fell back to recomputing the prompt on the decode worker."""
    log = "".join(gateway.lines)
    assert "no kv_connector detected" not in log and "prefill returned no kv_transfer_params" not in log, \
        gateway.log()


def pool_full(worker) -> bool:
    """Nothing running or waiting and every page back (cached prefix pages count as free)."""
    load = worker_load(worker.address)
    return load.num_used_tokens == 0 and load.num_running_reqs == 0 and load.num_waiting_reqs == 0


class Cluster:
    def __init__(self, cache_dir: str):
        self.cache_dir = cache_dir
        self.procs = []

    def start(self):
        def worker(*args, env=None):
            w = start_worker(self.cache_dir, *args, env=env)
            self.procs.append(w)  # one at a time: teardown kills what started if a later one fails
            return w

        def gateway(*args, **kwargs):
            g = SmgProcess(*args, **kwargs)
            self.procs.append(g)
            return g

        self.prefill = worker("--role", "prefill")
        self.decode = worker("--role", "decode")
        self.both = worker("--role", "both")
        self.pd = gateway([], "round_robin", *SMG_FLAGS, prefill=[self.prefill.address],
                          decode=[self.decode.address])
        self.plain = gateway([self.both.address], "round_robin", *SMG_FLAGS)
        self.worker, self.gateway = worker, gateway

    def client(self, gateway):
        return openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(compile_cache_dir(tmp_path_factory))
    try:
        c.start()
        yield c
    finally:
        kill_all(*reversed(c.procs))


@pytest.fixture(scope="module")
def expected(cluster):
    """The `both` worker's answers to the workload, in order (its cache sees the same prefixes)."""
    client = cluster.client(cluster.plain)
    return [complete(client, cluster.plain.model, req) for req in workload()]


@pytest.mark.slow
def test_gateway_sees_one_prefill_and_one_decode_worker(cluster):
    workers = {w["url"]: w for w in cluster.pd.get("/workers")["workers"]}
    assert workers[f"grpc://{cluster.prefill.address}"]["worker_type"] == "prefill"
    assert workers[f"grpc://{cluster.decode.address}"]["worker_type"] == "decode"
    # What makes smg take its NIXL-style relay (any other kv_connector: no KV handed over).
    roles = {w: server_info(w) for w in (cluster.prefill, cluster.decode, cluster.both)}
    assert [(i.kv_connector, i.kv_role) for i in roles.values()] == \
        [("NixlConnector", "kv_producer"), ("NixlConnector", "kv_consumer"), ("", "")]  # both: plain worker


def test_twenty_mixed_requests_match_one_both_worker(cluster, expected):
    client = cluster.client(cluster.pd)
    got = [complete(client, cluster.pd.model, req) for req in workload()]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, (i, workload()[i], g, e)  # text, finish reason, (prompt, completion, cached) tokens
    assert {e["finish"] for e in expected} == {"length", "stop"}  # both kinds were exercised
    assert sum(e["usage"][2] for e in expected) > 0  # and the shared prefix was cached
    assert_kv_relayed(cluster.pd)
    for w in (cluster.prefill, cluster.decode):
        wait_until(lambda: pool_full(w), WAIT_S, f"{w.address}'s pages to come back")


def test_five_cancelled_mid_decode_free_both_pools(cluster):
    client = cluster.client(cluster.pd)
    aborted_before = counter(cluster.decode, "jaxfill_request_success_total", finished_reason="abort")
    generated_before = counter(cluster.decode, "jaxfill_generation_tokens_total")
    for i in range(5):
        stream = client.completions.create(model=cluster.pd.model, prompt=VERSE[i * 7: i * 7 + 60],
                                           max_tokens=120, temperature=0, stream=True)
        for n, _ in enumerate(stream):
            if n == 2:
                break
        stream.close()  # the gateway aborts the decode leg
    wait_until(lambda: counter(cluster.decode, "jaxfill_request_success_total", finished_reason="abort")
               - aborted_before >= 5, WAIT_S, "five aborts on the decode worker")
    assert counter(cluster.decode, "jaxfill_generation_tokens_total") - generated_before < 5 * 120
    for w in (cluster.prefill, cluster.decode):
        wait_until(lambda: pool_full(w), WAIT_S, f"{w.address}'s pages to come back")


def assert_same_answers(client, gateway, picked, expected):
    """Each picked workload request through `gateway` gives the one-worker answer."""
    for i in picked:
        got = complete(client, gateway.model, workload()[i])
        assert (got["text"], got["finish"], got["usage"][:2]) == \
            (expected[i]["text"], expected[i]["finish"], expected[i]["usage"][:2]), (i, got, expected[i])


def test_a_request_the_decode_worker_refuses_frees_the_prefill_pool_at_once(cluster):
    """prompt + max_tokens over max_model_len: smg's prefill leg (max_tokens=1) is served and
    its pages held for the transfer, then the decode worker refuses the request. Before,
    nothing released them until engine.kv_transfer_timeout_s (30 s); now the refusal does."""
    client = cluster.client(cluster.pd)
    prefilled_before = counter(cluster.prefill, "jaxfill_request_success_total")
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=cluster.pd.model, prompt=VERSE[:120], max_tokens=200, temperature=0)
    assert e.value.status_code == 400 and "max_tokens" in str(e.value.message), e.value
    assert counter(cluster.prefill, "jaxfill_request_success_total") > prefilled_before  # the prefill leg ran
    wait_until(lambda: pool_full(cluster.prefill), 3, "the prefill worker's held pages to come back")

def test_prefill_tensor_2_decode_tensor_1_same_tokens(cluster, expected):
    tp2 = cluster.worker("--role", "prefill", "--set", "mesh.tensor=2", env=TWO_FAKE_DEVICES)
    gateway = cluster.gateway([], "round_robin", *SMG_FLAGS, prefill=[tp2.address], decode=[cluster.decode.address])
    client = cluster.client(gateway)
    picked = [0, 1, 3, 4, 5, 8]  # greedy, seeded, stop string, prompts of 4 to 190 tokens
    assert_same_answers(client, gateway, picked, expected)
    assert_kv_relayed(gateway)
    for w in (tp2, cluster.decode):
        wait_until(lambda: pool_full(w), WAIT_S, f"{w.address}'s pages to come back")


@pytest.mark.slow
def test_prefill_data_2_decode_data_2_same_tokens(cluster, expected):
    """A prefill and a decode worker with two data replicas each (two page pools in one
    cache): rows exported from, and imported into, whichever replica holds the request.
    With --dp-aware smg pins data_parallel_rank on both legs (0, 1, 0, ... as logged once on
    2026-12-07), so both replicas of each worker serve."""
    workers = [cluster.worker("--role", role, "--set", "mesh.data=2", env=TWO_FAKE_DEVICES)
               for role in ("prefill", "decode")]
    assert all(server_info(w).data_parallel_size == 2 for w in workers)
    gateway = cluster.gateway([], "round_robin", *SMG_FLAGS, "--dp-aware", prefill=[workers[0].address],
                              decode=[workers[1].address])
    client = cluster.client(gateway)
    picked = [0, 1, 3, 4, 5, 8, 9, 12]  # greedy, seeded, stop string, a shared prefix, 4 to 190 tokens
    assert_same_answers(client, gateway, picked, expected)
    assert_kv_relayed(gateway)
    for w in workers:
        wait_until(lambda: pool_full(w), WAIT_S, f"{w.address}'s pages to come back")
    kill_all(gateway, *workers)  # the machine has 2 cores: the later tests start more processes


@pytest.mark.slow
@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_two_process_worker_same_tokens(cluster, expected, role):
    """A prefill or decode worker over two processes (one CPU device and one data replica
    each): process 0 serves gRPC and the transfer server, process 1 runs every gather and
    scatter with it (engine/disagg/runner_side.py)."""
    port = free_port()
    env = {"XLA_FLAGS": fake_devices(1), "JAX_PLATFORMS": "cpu"}
    args = ["--role", role, "--set", "mesh.data=2", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
    sets = [a for s in WORKER_SETTINGS for a in ("--set", s)]
    follower = ServeProcess("--config", "tiny", "--metrics-port", "0", *sets, *args, "--process-id", "1",
                            cache_dir=cluster.cache_dir, env=env, listens=False)
    cluster.procs.append(follower)
    try:
        leader = cluster.worker(*args, "--process-id", "0", env=env)
    except (TimeoutError, RuntimeError) as e:  # once (2026-12-07, full module, busy machine): 300 s start-up
        raise AssertionError(f"{e}\nprocess 1:\n{follower.log()[-3000:]}") from None
    pools = {"prefill": [cluster.prefill.address], "decode": [cluster.decode.address], role: [leader.address]}
    gateway = cluster.gateway([], "round_robin", *SMG_FLAGS, "--dp-aware", prefill=pools["prefill"],
                              decode=pools["decode"])
    client = cluster.client(gateway)
    assert_same_answers(client, gateway, [0, 1, 3, 4, 5, 8], expected)
    assert_kv_relayed(gateway)
    wait_until(lambda: pool_full(leader), WAIT_S, f"{leader.address}'s pages to come back")
    kill_all(gateway, leader, follower)


def test_killed_prefill_worker_fails_its_requests_and_frees_the_decode_pool(cluster):  # keep last: kills it
    """Last in the module: it kills the cluster's prefill worker while three long prompts
    are in its hands (prefilling, or prefilled and waiting for the decode side's pull)."""
    client = cluster.client(cluster.pd)
    outcomes = []

    def long_request(i: int):
        try:
            outcomes.append(complete(client, cluster.pd.model, {"prompt": f"{i} " + VERSE, "max_tokens": 40,
                                                                "temperature": 0.0, "stream": False}))
        except Exception as e:  # noqa: BLE001 - asserted below
            outcomes.append(e)

    threads = [threading.Thread(target=long_request, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    wait_until(lambda: worker_load(cluster.prefill.address).num_used_tokens > 0, 30,
               "the prefill worker to hold prompt pages", interval=0.005)
    cluster.prefill.kill()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "a request hung after its prefill worker died"
    # Each one failed with an error, or (handed off before the kill) was served in full.
    assert len(outcomes) == 3 and any(isinstance(o, Exception) for o in outcomes), outcomes
    assert all(isinstance(o, Exception) or o["usage"][1] == 40 for o in outcomes), outcomes
    wait_until(lambda: pool_full(cluster.decode), WAIT_S, "the decode worker's pages to come back")

