"""jaxfill workers behind the real `smg` gateway (PyPI `smg`), driven by the real `openai`
client, loopback only: OpenAI HTTP in front, vllm.grpc.engine.VllmEngine behind.

One gateway (cache_aware policy) over two `jaxfill serve --config tiny` workers per module;
every process is killed at the end, even on failure."""

from __future__ import annotations

import threading
import uuid

import pytest

from gateway_util import (SmgProcess, kill_all, smg_binary, start_worker, wait_until, worker_healthy,
                          worker_load, WORKER_SETTINGS)
from serving_util import compile_cache_dir, scrape

import openai  # the test extra installs it, and smg: missing is a failure, never a skip

assert smg_binary(), "the smg gateway binary is not on PATH: pip install -e '.[test]'"

MAX_TOKENS = 24
# Fail over fast: a dead worker is noticed within a second and retried elsewhere.
SMG_FLAGS = ["--health-check-interval-secs", "1", "--health-failure-threshold", "1",
             "--health-success-threshold", "1", "--retry-max-retries", "6", "--retry-initial-backoff-ms", "200",
             "--retry-max-backoff-ms", "1000"]


class Cluster:
    def __init__(self, cache_dir: str):
        self.cache_dir = cache_dir
        self.workers = []
        self.gateway = None

    def start(self):
        for _ in range(2):  # one at a time, so teardown kills the first if the second fails
            self.workers.append(start_worker(self.cache_dir))
        self.gateway = SmgProcess([w.address for w in self.workers], "cache_aware", *SMG_FLAGS)
        self.client = openai.OpenAI(base_url=self.gateway.base_url, api_key="unused", max_retries=0, timeout=60)

    def counters(self, worker) -> dict:
        m = scrape(worker.metrics_port)
        out = {"hits": 0.0, "prompt_tokens": 0.0, "generated": 0.0, "requests": 0.0, "aborted": 0.0}
        for (name, labels), v in m.items():
            d = dict(labels)
            if name == "jaxfill_prefix_cache_hits_total":
                out["hits"] += v
            elif name == "jaxfill_prompt_tokens_total":
                out["prompt_tokens"] += v
            elif name == "jaxfill_generation_tokens_total":
                out["generated"] += v
            elif name == "jaxfill_request_success_total":
                out["requests"] += v
                if d.get("finished_reason") in ("abort", "cancelled"):
                    out["aborted"] += v
        return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(compile_cache_dir(tmp_path_factory))
    try:
        c.start()
        yield c
    finally:
        kill_all(c.gateway, *c.workers)


@pytest.fixture(scope="module")
def reference(cluster):
    """Engine.generate on the workers' config, greedy: the tokens the gateway must return."""
    from jaxfill.engine.config import load_config
    from jaxfill.engine.engine import Engine
    from jaxfill.engine.request import SamplingParams
    from jaxfill.engine.tokenizer import load_tokenizer

    overrides = {}
    for s in WORKER_SETTINGS:
        key, value = s.split("=", 1)
        overrides[key] = eval(value)  # noqa: S307 - our own literal settings
    config = load_config("tiny", overrides)
    engine = Engine(config, progress=False)
    tokenizer = load_tokenizer(config.model, config.model_path)

    def generate(ids: list[int]) -> tuple[list[int], str]:
        done = engine.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0]
        return list(done.token_ids), tokenizer.decode(done.token_ids)

    yield generate
    engine.close()


def prompt_ids(text: str) -> list[int]:
    """What the gateway sends for a prompt: the tokenizer's ids without BOS (checked against
    usage.prompt_tokens below)."""
    return list(text.encode())


def chat_text(messages) -> str:
    """tokenizer_config.json's chat template, as the gateway renders it."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


@pytest.mark.slow
def test_completions_plain_and_streaming_match_engine_generate(cluster, reference):
    prompt = "ROMEO:\nWhat light through yonder"
    ids = prompt_ids(prompt)
    expected_ids, expected_text = reference(ids)
    c = cluster.client
    r = c.completions.create(model=cluster.gateway.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == expected_text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(expected_ids))
    pieces, usage = [], None
    for chunk in c.completions.create(model=cluster.gateway.model, prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0, stream=True, stream_options={"include_usage": True}):
        pieces += [ch.text for ch in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(pieces) == expected_text and len([p for p in pieces if p]) > 1
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), len(expected_ids))


def test_chat_plain_and_streaming_match_engine_generate(cluster, reference):
    messages = [{"role": "system", "content": "Speak verse."}, {"role": "user", "content": "Who is there?"}]
    ids = prompt_ids(chat_text(messages))
    expected_ids, expected_text = reference(ids)
    c = cluster.client
    r = c.chat.completions.create(model=cluster.gateway.model, messages=messages, max_tokens=MAX_TOKENS,
                                  temperature=0)
    assert r.choices[0].message.content == expected_text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(expected_ids))
    pieces, usage = [], None
    for chunk in c.chat.completions.create(model=cluster.gateway.model, messages=messages, max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True, stream_options={"include_usage": True}):
        pieces += [ch.delta.content or "" for ch in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(pieces) == expected_text and len([p for p in pieces if p]) > 1
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), len(expected_ids))


def test_cache_aware_routes_a_shared_prefix_to_the_worker_that_cached_it(cluster):
    prefix = f"[{uuid.uuid4().hex}] " + "Now is the winter of our discontent made glorious summer. " * 2
    before = [cluster.counters(w) for w in cluster.workers]
    c = cluster.client
    cached = []
    for i in range(5):
        r = c.completions.create(model=cluster.gateway.model, prompt=prefix + f"Verse {i}:", max_tokens=4,
                                 temperature=0)
        cached.append(r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0)
    after = [cluster.counters(w) for w in cluster.workers]
    served = [a["requests"] - b["requests"] for a, b in zip(after, before)]
    hits = [a["hits"] - b["hits"] for a, b in zip(after, before)]
    owner = served.index(max(served))
    assert served[owner] == 5 and served[1 - owner] == 0, served  # every request on one worker
    full_pages = len(prompt_ids(prefix)) // 16 * 16
    assert hits[owner] >= 4 * full_pages and hits[1 - owner] == 0, hits  # the 4 later ones hit its cache
    assert cached[0] == 0 and all(n >= full_pages for n in cached[1:]), cached


def test_unsupported_field_is_the_workers_invalid_argument_as_http_400(cluster):
    before = [cluster.counters(w)["requests"] for w in cluster.workers]
    with pytest.raises(openai.BadRequestError) as e:  # smg forwards a top-level "regex" as the constraint
        cluster.client.completions.create(model=cluster.gateway.model, prompt="Hello", max_tokens=4,
                                          extra_body={"regex": "([a-z"})
    assert e.value.status_code == 400
    assert "sampling_params.regex" in str(e.value) and "unclosed" in str(e.value)
    assert [cluster.counters(w)["requests"] for w in cluster.workers] == before  # nothing ran


def test_client_disconnect_mid_stream_aborts_on_the_worker_and_frees_its_pages(cluster):
    before = [cluster.counters(w) for w in cluster.workers]
    stream = cluster.client.completions.create(model=cluster.gateway.model, prompt="To be, or not to be",
                                               max_tokens=200, temperature=0, stream=True)
    received = 0
    for chunk in stream:
        received += 1
        if received == 3:
            break
    stream.close()  # drops the HTTP connection: the gateway must Abort on the worker

    def aborted():
        after = [cluster.counters(w) for w in cluster.workers]
        return sum(a["aborted"] - b["aborted"] for a, b in zip(after, before)) == 1 and after

    after = wait_until(aborted, 30, "the worker to count the aborted request")
    generated = sum(a["generated"] - b["generated"] for a, b in zip(after, before))
    assert generated < 200, generated  # it stopped early, it did not run to max_tokens
    for w in cluster.workers:  # every page back in the pool (cached prefix pages are free ones)
        wait_until(lambda: worker_load(w.address).num_used_tokens == 0, 30, "the worker's pages to come back")


def test_killed_worker_fails_over_then_rejoins_after_restart(cluster):
    victim = cluster.workers[1]
    results, errors = [], []
    stop = threading.Event()

    def client_loop(k: int):
        i = 0
        while not stop.is_set():  # keep requests in flight until well after the kill
            i += 1
            try:
                r = cluster.client.completions.create(model=cluster.gateway.model, prompt=f"{uuid.uuid4().hex} {k}.{i}:",
                                                      max_tokens=48, temperature=0)
                results.append(r.usage.completion_tokens)
            except Exception as e:  # noqa: BLE001 - collected and asserted below
                errors.append(repr(e))

    threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: worker_load(victim.address).num_running_reqs > 0, 120,
                   "requests running on the victim", interval=0.005)
        victim.kill()  # mid-run: requests are in flight on it
        done_at_kill = len(results)
        wait_until(lambda: len(results) >= done_at_kill + 8 or errors, 120, "requests after the kill")
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert not errors, errors
    assert len(results) >= 8 and all(n == 48 for n in results), results

    url = f"grpc://{victim.address}"
    port = victim.port
    replacement = start_worker(cluster.cache_dir, "--port", str(port))
    cluster.workers[1] = replacement
    assert worker_healthy(replacement.address)

    def rejoined():
        workers = cluster.gateway.get("/workers")["workers"]
        return any(w["url"] == url and w["is_healthy"] for w in workers)

    wait_until(rejoined, 60, "the gateway to see the restarted worker healthy")
    before = cluster.counters(replacement)["requests"]
    for i in range(8):  # distinct prompts: the policy balances them over both workers
        cluster.client.completions.create(model=cluster.gateway.model, prompt=f"{uuid.uuid4().hex} {i}",
                                          max_tokens=2, temperature=0)
    assert cluster.counters(replacement)["requests"] > before


def test_response_format_json_schema_reaches_the_worker_as_a_constraint(cluster):
    """OpenAI's response_format (chat and completions) arrives as the json_schema
    constraint: every sample parses and fits the schema; a malformed schema is an HTTP 400."""
    import json

    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    for seed in range(3):
        chat = cluster.client.chat.completions.create(
            model=cluster.gateway.model, messages=[{"role": "user", "content": "Who?"}], max_tokens=60,
            temperature=1.0, seed=seed, response_format=fmt)
        value = json.loads(chat.choices[0].message.content)
        assert set(value) == {"name", "n"} and 0 <= value["n"] <= 99, value
        assert chat.choices[0].finish_reason == "stop"
    obj = cluster.client.chat.completions.create(
        model=cluster.gateway.model, messages=[{"role": "user", "content": "Any"}], max_tokens=60,
        temperature=0.0, response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason != "stop" or isinstance(json.loads(obj.choices[0].message.content), dict)
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objectx"}}}
    with pytest.raises(openai.BadRequestError) as e:
        cluster.client.chat.completions.create(model=cluster.gateway.model, max_tokens=4, response_format=bad,
                                               messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 400 and "json_schema" in str(e.value), str(e.value)


def test_n_samples_through_the_gateway(cluster, reference):
    """n = 3 on completions: three choices (index 0..2), greedy ones equal to one request."""
    out = cluster.client.completions.create(model=cluster.gateway.model, prompt="ROMEO:", max_tokens=MAX_TOKENS,
                                            n=3, temperature=0.0)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    _ids, text = reference(prompt_ids("ROMEO:"))
    assert all(c.text == text for c in out.choices)
    sampled = cluster.client.completions.create(model=cluster.gateway.model, prompt="ROMEO:", max_tokens=8, n=3,
                                                temperature=1.0, seed=4)
    assert len({c.text for c in sampled.choices}) > 1, [c.text for c in sampled.choices]
    assert out.usage.prompt_tokens == len(prompt_ids("ROMEO:")), out.usage


def test_chat_logprobs_arrive_streaming_and_not(cluster):
    """Chat: logprobs / top_logprobs reach the client (tokens, values <= 0, k alternatives,
    the chosen token's value among them for greedy). smg 1.13's /v1/completions returns
    logprobs None although the worker sends output_logprobs (README's field table)."""
    messages = [{"role": "user", "content": "Who is there?"}]
    kw = dict(model=cluster.gateway.model, messages=messages, max_tokens=6, temperature=0, logprobs=True,
              top_logprobs=3)
    r = cluster.client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-5  # greedy: the chosen token is the top one
    streamed = [t for chunk in cluster.client.chat.completions.create(**kw, stream=True)
                for ch in chunk.choices if ch.logprobs for t in ch.logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t.token, round(t.logprob, 4)) for t in content]
