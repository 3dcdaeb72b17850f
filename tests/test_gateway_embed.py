"""Pooling and logprobs through the real `smg` gateway (PyPI smg 1.13) in front of one
`jaxfill serve --model DIR` worker (a random-init Qwen3 with sentence-transformers' module
files: last-token pooling, normalized; a word tokenizer with a pass-through chat template),
driven by the `openai` client and plain HTTP on loopback.

What smg does with each route is pinned here, so an smg upgrade that changes it fails a
test instead of passing unnoticed (docs/embeddings.md, "Through the gateway")."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from embed_refs import write_st_modules
from gateway_util import SmgProcess, kill_all, smg_binary, wait_until, worker_healthy
from hf_models import make_hf_checkpoint
from serving_util import ServeProcess, compile_cache_dir

import openai  # the test extra installs it, and smg: missing is a failure, never a skip

assert smg_binary(), "the smg gateway binary is not on PATH: pip install -e '.[test]'"

SETTINGS = {"engine.num_pages": 40, "engine.max_model_len": 64, "engine.max_num_seqs": 4,
            "engine.max_num_batched_tokens": 64, "engine.token_buckets": [64], "mesh.cpu_split": False,
            "engine.attention_impl": "reference"}
TEXTS = ["w1 w2 w3", "w7 w8 w9 w10 w11 w12 w13", "w300"]
PROMPT = "w5 w6 w7 w8"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the prompt is the message
TOP = 3
MAX_TOKENS = 5


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    d = make_hf_checkpoint(str(tmp_path_factory.mktemp("qwen3_embed")), "qwen3")
    write_st_modules(d, "last", True, hidden=64)
    path = f"{d}/tokenizer_config.json"
    with open(path) as f:
        cfg = json.load(f)
    with open(path, "w") as f:
        json.dump({**cfg, "chat_template": CHAT_TEMPLATE}, f)
    return d


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, checkpoint):
    cache = compile_cache_dir(tmp_path_factory)
    worker = gw = None
    try:
        worker = ServeProcess("--model", checkpoint, "--config", "tiny", "--metrics-port", "0",
                              *[a for k, v in SETTINGS.items() for a in ("--set", f"{k}={json.dumps(v)}")], cache_dir=cache)
        wait_until(lambda: worker_healthy(worker.address), 300, "the worker's warm-up", interval=0.2)
        gw = SmgProcess([worker.address])
        yield worker, gw, openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=60)
    finally:
        kill_all(gw, worker)


@pytest.fixture(scope="module")
def reference(gateway, checkpoint):
    """In-process Engine on the worker's checkpoint and settings: the embeddings of TEXTS and
    of their space-joined text, greedy logprobs of PROMPT, the tokenizer."""
    from jaxfill.engine.engine import Engine
    from jaxfill.engine.request import SamplingParams

    engine = Engine.from_config("tiny", model_path=checkpoint, overrides=SETTINGS, progress=False)
    lp = engine.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                                  logprobs=TOP))[0]
    return engine.embed(TEXTS + [" ".join(TEXTS)]), lp, engine.tokenizer


def post(gw: SmgProcess, path: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{gw.port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_embeddings_equal_engine_embed(gateway, reference):
    _w, gw, client = gateway
    want = reference[0]
    for fmt in ("float", "base64"):  # the openai client asks base64 unless told
        for text, w in zip(TEXTS, want):
            got = client.embeddings.create(model=gw.model, input=text, encoding_format=fmt)
            (d,) = got.data
            assert len(d.embedding) == 64 and cosine(d.embedding, w) > 1 - 1e-5
            np.testing.assert_allclose(d.embedding, w, atol=1e-5)
            assert got.usage.prompt_tokens == len(text.split())
    status, body = post(gw, "/v1/embeddings", {"model": gw.model, "input": TEXTS[0]})
    assert status == 200 and cosine(json.loads(body)["data"][0]["embedding"], want[0]) > 1 - 1e-5


def test_a_list_input_is_one_embedding_of_the_joined_texts(gateway, reference):
    """smg 1.13 joins a list `input` with spaces and sends one Embed: one vector comes back."""
    _w, gw, client = gateway
    got = client.embeddings.create(model=gw.model, input=TEXTS, encoding_format="float")
    (d,) = got.data
    assert cosine(d.embedding, reference[0][len(TEXTS)]) > 1 - 1e-5
    assert got.usage.prompt_tokens == sum(len(t.split()) for t in TEXTS)


def test_what_smg_answers_for_token_ids_rerank_and_score(gateway):
    """smg 1.13: token-id embedding input, rerank and score do not reach a gRPC worker."""
    _w, gw, _client = gateway
    status, body = post(gw, "/v1/embeddings", {"model": gw.model, "input": [[1, 2, 3]]})
    assert status == 400 and json.loads(body)["error"]["code"] == "empty_input", body
    docs = {"model": gw.model, "query": "w1 w2", "documents": ["w3 w4", "w5"]}
    for path in ("/v1/rerank", "/rerank"):
        assert post(gw, path, docs) == (501, "Rerank not implemented")
    for path in ("/v1/score", "/score"):
        status, body = post(gw, path, {"model": gw.model, "text_1": "w1", "text_2": ["w3"]})
        assert status == 404 and json.loads(body)["error"]["code"] == "unknown_url", body


def test_classify_is_a_softmax_over_the_embed_vector(gateway, reference):
    """smg 1.13's /v1/classify calls Embed too and reads the vector as class logits: for an
    embedding model, a softmax over the hidden size with made-up LABEL_<i> names."""
    _w, gw, _client = gateway
    status, body = post(gw, "/v1/classify", {"model": gw.model, "input": TEXTS[0]})
    assert status == 200, body
    (d,) = json.loads(body)["data"]
    v = reference[0][0].astype(np.float64)
    want = np.exp(v - v.max()) / np.exp(v - v.max()).sum()
    np.testing.assert_allclose(d["probs"], want, atol=1e-5)
    assert d["label"] == f"LABEL_{int(np.argmax(v))}"


def _assert_top(entries, want, tokenizer):
    """entries: (token text, logprob, [(text, logprob)] * TOP) per position; want: Completion.logprobs."""
    assert len(entries) == MAX_TOKENS
    for (text, lp, top), w in zip(entries, want):
        assert text == tokenizer.decode([w["token_id"]]) and abs(lp - w["logprob"]) < 1e-4
        assert len(top) == TOP == len(w["top"])
        for (t, v), (wid, wv) in zip(top, w["top"]):
            assert t == tokenizer.decode([wid]) and abs(v - wv) < 1e-4


def test_chat_top_logprobs_equal_engine_generate(gateway, reference):
    _w, gw, client = gateway
    _vecs, want, tok = reference
    got = client.chat.completions.create(model=gw.model, messages=[{"role": "user", "content": PROMPT}],
                                         max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=TOP,
                                         extra_body={"ignore_eos": True})
    _assert_top([(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs])
                 for c in got.choices[0].logprobs.content], want.logprobs, tok)


def test_worker_sends_completions_top_logprobs(gateway, reference):
    """What smg reads for /v1/completions logprobs=3: GenerateComplete.output_logprobs, three
    alternatives per token, equal to Engine.generate's."""
    worker, _gw, _client = gateway
    _vecs, want, tok = reference
    req = vpb.GenerateRequest(request_id="lp", tokenized=vpb.TokenizedInput(input_ids=tok.encode(PROMPT)),
                              sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                 ignore_eos=True, logprobs=TOP))
    with grpc.insecure_channel(worker.address) as ch:
        (msg,) = list(vpb_grpc.VllmEngineStub(ch).Generate(req, timeout=60))
    lp = msg.complete.output_logprobs
    _assert_top([(tok.decode([t]), v, [(tok.decode([i]), x) for i, x in zip(top.token_ids, top.values)])
                 for t, v, top in zip(lp.token_ids, lp.token_logprobs, lp.top_logprobs)], want.logprobs, tok)


def test_completions_logprobs_are_dropped_by_smg(gateway):
    """smg 1.13's /v1/completions answer carries no `logprobs` (stream or not) although the
    worker sent them (the test above): the gap is smg's. Fails once smg maps them."""
    _w, gw, client = gateway
    got = client.completions.create(model=gw.model, prompt=PROMPT, logprobs=TOP, max_tokens=MAX_TOKENS,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].text and got.choices[0].logprobs is None
    chunks = list(client.completions.create(model=gw.model, prompt=PROMPT, logprobs=TOP, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert chunks and all(c.choices[0].logprobs is None for c in chunks if c.choices)
