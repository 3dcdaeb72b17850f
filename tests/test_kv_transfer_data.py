"""Disaggregated prefill with data replicas (mesh.data = 2) on either side.

One subprocess on 2 fake CPU devices holds three engines: P1 (one device; it also does
whole requests itself, the colocated reference), P2 and D2 (mesh.data = 2: two page
pools in one cache, replica r's page p at r * num_pages + p). Several prompts go
through each hand-off so both replicas hold some: P2 -> D2, P1 -> D2 (one pinned to
replica 1, as the protocol's data_parallel_rank does) and P2 -> P1. Every page of every
pool starts NaN, so rows exported from (or imported into) the other replica's pool give
NaN logits and other tokens. Greedy tokens must equal the colocated engine's, and every
page comes back on both sides.
"""

import json
import os
import subprocess
import sys

import pytest
from xla_flags import fake_devices
from fast_engine import REFERENCE_ATTENTION

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = {**REFERENCE_ATTENTION,  # tests/fast_engine.py
        "engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64], "engine.num_pages": 32,
        "engine.max_model_len": 128, "engine.max_num_seqs": 4, "engine.kv_transfer_timeout_s": 60,
        "engine.kv_fill_value": float("nan")}  # every page starts NaN: a row from the wrong pool shows

SCRIPT = r"""
import json, sys, time
from jaxfill.engine.disagg import transfer as kvt
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import InvalidRequest, SamplingParams

base = json.loads(sys.argv[1])
def make(page_size, data):
    return Engine.from_config("tiny_random", overrides={**base, "engine.page_size": page_size, "mesh.data": data},
                              progress=False)

p1, p2, d2 = make(16, 1), make(16, 2), make(8, 2)
prompts = [[(7 * i + 3 * k + 1) % 250 for i in range(20 + 9 * k)] for k in range(4)]
params = SamplingParams(max_tokens=8, ignore_eos=True)
want = [c.token_ids for c in p1.generate(prompts, params)]

def prefill(src):
    rids = [src.add_request(p, SamplingParams(max_tokens=1, ignore_eos=True)) for p in prompts]
    for rid in rids:
        src.hold_pages(rid)
    replicas = [src.requests[r].replica for r in rids]
    while src.has_unfinished():
        src.step()
    return [src.take_kv_offer(r) for r in rids], replicas

def decode(src, dst, pins):
    infos, src_replicas = prefill(src)
    rids = []
    for k, (info, pin) in enumerate(zip(infos, pins)):
        arrays, n = dst.enable_kv_transfer().pull(info, prompts[k])
        assert kvt.wait_ready(arrays, time.monotonic() + 60)
        rids.append(dst.add_prefilled_request(prompts[k], params, f"d{k}", arrays, n, replica=pin))
    dst_replicas = [dst.requests[r].replica for r in rids]
    got = {}
    while dst.has_unfinished():
        for out in dst.step():
            if out.finished:
                got[out.request_id] = out.completion.token_ids
    released = [src.release_held(i["transfer_id"]) for i in infos]
    return {"tokens": [got[r] for r in rids], "src_replicas": src_replicas, "dst_replicas": dst_replicas,
            "released": released, "src_free": src.stats()["pages_free"] == src.stats()["pages_total"],
            "dst_free": dst.stats()["pages_free"] == dst.stats()["pages_total"]}

out = {"want": want, "p2_d2": decode(p2, d2, [None] * 4), "p1_d2": decode(p1, d2, [None, 1, None, None]),
       "p2_p1": decode(p2, p1, [None] * 4)}
pinned = [d2.add_request(p, params, replica=1) for p in prompts[:2]]  # placement alone would split them
out["pinned_replicas"] = [d2.requests[r].replica for r in pinned]
done = {}
while d2.has_unfinished():
    done.update({o.request_id: o.completion.token_ids for o in d2.step() if o.finished})
out["pinned_tokens"] = [done[r] for r in pinned]
try:
    d2.add_request(prompts[0], params, replica=2)
except InvalidRequest as e:
    out["bad_rank"] = str(e)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def runs():
    env = dict(os.environ, XLA_FLAGS=fake_devices(2))
    r = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(BASE)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("flow", ["p2_d2", "p1_d2", "p2_p1"])
def test_handoff_with_data_replicas_equals_one_engine(runs, flow):
    r = runs[flow]
    assert len({tuple(t) for t in runs["want"]}) == 4  # four different continuations
    assert r["tokens"] == runs["want"]
    if flow.startswith("p2"):
        assert sorted(r["src_replicas"]) == [0, 0, 1, 1]  # both prefill pools exported
    if flow.endswith("d2"):
        assert sorted(r["dst_replicas"]) == [0, 0, 1, 1]  # both decode pools imported
    if flow == "p1_d2":
        assert r["dst_replicas"][1] == 1  # pinned (data_parallel_rank)
    assert all(r["released"]) and r["src_free"] and r["dst_free"]


@pytest.mark.slow
def test_a_pinned_request_runs_on_its_replica(runs):
    assert runs["pinned_replicas"] == [1, 1] and runs["pinned_tokens"] == runs["want"][:2]


@pytest.mark.slow
def test_a_rank_outside_the_mesh_names_the_field(runs):
    assert "data_parallel_rank" in runs["bad_rank"] and "[0, 2)" in runs["bad_rank"]
