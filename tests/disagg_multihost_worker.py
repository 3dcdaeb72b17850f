"""One process of tests/test_disagg_multihost.py: disaggregated prefill between a
one-process engine and an engine over two processes (jax.distributed on 127.0.0.1, one
CPU device each, mesh.data = 2: each replica's page pool on its own process).

    python tests/disagg_multihost_worker.py single
    python tests/disagg_multihost_worker.py multi PROCESS_ID PORT

Messages are JSON lines on stdout after PREFIX (gloo prints there too); the test relays them:

    single: {"want", "offers"}  <- offers of the multi engine  -> {"tokens", "free"}
    multi 0: <- offers of the single engine -> {"tokens", "replicas", "offers", "prefill_replicas"}
             <- "pulled" -> {"free"}
    multi 1: follows process 0's steps, exports and imports.
"""

from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fast_engine import REFERENCE_ATTENTION  # noqa: E402

BASE = {**REFERENCE_ATTENTION, "engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64],
        "engine.num_pages": 32, "engine.max_model_len": 128, "engine.max_num_seqs": 4,
        "engine.kv_transfer_timeout_s": 120, "engine.kv_fill_value": float("nan")}  # a wrong row shows
PROMPTS = [[(7 * i + 3 * k + 1) % 250 for i in range(20 + 9 * k)] for k in range(4)]
MAX_TOKENS = 8
PREFIX = "MSG "


def say(msg) -> None:
    print(PREFIX + json.dumps(msg), flush=True)


def hear():
    return json.loads(sys.stdin.readline())


def prefill(engine):
    """Every prompt prefilled with its pages held: (offers, the replica each ran on)."""
    from jaxfill.engine.request import SamplingParams

    rids = [engine.add_request(p, SamplingParams(max_tokens=1, ignore_eos=True)) for p in PROMPTS]
    for rid in rids:
        engine.hold_pages(rid)
    replicas = [engine.requests[r].replica for r in rids]
    while engine.has_unfinished():
        engine.step()
    return [engine.take_kv_offer(r) for r in rids], replicas


def decode(engine, offers):
    """Pulls every offer and runs the requests to the end: (tokens, the replica each ran on)."""
    from jaxfill.engine.disagg import transfer as kvt
    from jaxfill.engine.request import SamplingParams

    rids = []
    for k, info in enumerate(offers):
        arrays, n = engine.enable_kv_transfer().pull(info, PROMPTS[k])
        assert kvt.wait_ready(arrays, time.monotonic() + 120), "a pull did not arrive"
        rids.append(engine.add_prefilled_request(PROMPTS[k], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                                                 f"d{k}", arrays, n))
    replicas = [engine.requests[r].replica for r in rids]
    got = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.completion.token_ids
    return [got[r] for r in rids], replicas


def all_free(engine) -> bool:
    s = engine.stats()
    return s["pages_free"] == s["pages_total"]


def single():
    from jaxfill.engine.engine import Engine
    from jaxfill.engine.request import SamplingParams

    one = Engine.from_config("tiny_random", overrides={**BASE, "engine.page_size": 16}, progress=False)
    want = [c.token_ids for c in one.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]
    offers, _ = prefill(one)
    say({"want": want, "offers": offers})
    theirs = hear()  # sent once they have pulled ours
    released = [one.release_held(o["transfer_id"]) for o in offers]
    tokens, _ = decode(one, theirs)
    say({"tokens": tokens, "released": released, "free": all_free(one)})


def multi(process_id: int, port: int):
    from jaxfill.engine.engine import Engine

    over = {**BASE, "engine.page_size": 8, "mesh.data": 2, "mesh.num_processes": 2, "mesh.process_id": process_id,
            "mesh.coordinator": f"127.0.0.1:{port}"}
    with Engine.from_config("tiny_random", overrides=over, progress=False) as two:
        if not two.is_leader:
            two.follow()
            return
        tokens, replicas = decode(two, hear())
        offers, prefill_replicas = prefill(two)
        say({"tokens": tokens, "replicas": replicas, "offers": offers, "prefill_replicas": prefill_replicas})
        hear()  # the single engine has pulled
        released = [two.release_held(o["transfer_id"]) for o in offers]
        say({"released": released, "free": all_free(two)})


if __name__ == "__main__":
    if sys.argv[1] == "single":
        single()
    else:
        multi(int(sys.argv[2]), int(sys.argv[3]))
