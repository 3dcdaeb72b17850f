"""Disaggregated prefill at the engine level: a prompt's KV moved between two Engines by
JAX's transfer server (engine/disagg/transfer.py, engine/disagg/handoff.py).

The prefill engine (page_size 16) and the decode engine (page_size 8) differ in page size
and page ids; unused pages are NaN-filled so a row written to the wrong slot, or a
missing one, shows. The decode side must give exactly the tokens (and logprobs) of the
decode engine doing the whole request itself.
"""

import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfill.engine import kv_rows
from jaxfill.engine.disagg import transfer as kvt
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import QueueFull, SamplingParams
from jaxfill.models.kv_cache import KVCache
from jaxfill.pallas_kernels import QuantizedPages
from xla_flags import fake_devices
from fast_engine import REFERENCE_ATTENTION

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = {**REFERENCE_ATTENTION,  # tests/fast_engine.py
        "engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64], "engine.num_pages": 64,
        "engine.max_model_len": 256, "engine.max_num_seqs": 4}
PROMPT = [(7 * i + 3) % 250 for i in range(45)]  # 44 rows sent: 2.75 prefill pages, 5.5 decode pages
PREFILL_ONLY = SamplingParams(max_tokens=1, ignore_eos=True)


def make(page_size: int, **extra) -> Engine:
    e = Engine.from_config("tiny_random", overrides={**BASE, "engine.page_size": page_size, **extra}, progress=False)
    s = e.settings
    e.runner.kv_cache = KVCache.create(e.config.model, s.num_pages, page_size, fill_value=float("nan"),
                                       kv_cache_dtype=s.kv_cache_dtype, stages=e.runner.stages)
    return e


def prefill(engine: Engine, prompt=PROMPT) -> dict:
    rid = engine.add_request(prompt, PREFILL_ONLY)
    engine.hold_pages(rid)
    while engine.has_unfinished():
        engine.step()
    info = engine.take_kv_offer(rid)
    assert info is not None
    return info


def pull_and_admit(decode: Engine, info: dict, prompt, params, rid="d0") -> str:
    arrays, n = decode.enable_kv_transfer().pull(info, list(prompt))
    assert kvt.wait_ready(arrays, time.monotonic() + 30)
    return decode.add_prefilled_request(prompt, params, rid, arrays, n, info["cached_tokens"])


def run_one(engine: Engine, rid: str):
    done = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                done = out.completion
    return done


def layers(cache: KVCache) -> list:
    """Per-layer page arrays in layer order, whatever the layout (layer s*K + j is row s of
    entry j of a stacked cache)."""
    if cache.stages == 1:
        return list(cache.pages)
    return [jax.tree.map(lambda a: a[s], entry) for s in range(cache.stages) for entry in cache.pages]


def rows(engine: Engine, pages, n):
    """[L, n, 2*Hkv, D] values (and scales) of the first n tokens held in `pages`."""
    out = []
    for leaf in layers(engine.runner.kv_cache):
        parts = (leaf.values, leaf.scales) if isinstance(leaf, QuantizedPages) else (leaf,)
        out.append([np.asarray(p)[np.asarray(pages)].reshape((-1,) + p.shape[2:])[:n] for p in parts])
    return out


def assert_same_logprobs(got, want):
    """Same ids; values to 1e-5: the reference computes the last prompt token inside its
    prompt chunk, the decode side in a one-token step (another bucket: ~1e-7 apart in f32)."""
    if want is None:
        assert got is None
        return
    assert [(e["token_id"], [t for t, _ in e["top"]]) for e in got] == \
        [(e["token_id"], [t for t, _ in e["top"]]) for e in want]
    flat = lambda lps: [e["logprob"] for e in lps] + [v for e in lps for _, v in e["top"]]  # noqa: E731
    np.testing.assert_allclose(flat(got), flat(want), rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def engines():
    return make(16, **{"engine.kv_transfer_timeout_s": 60}), make(8)


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype,scan", [("auto", (False, False)), ("int8", (False, False)),
                                           ("auto", (True, False)), ("int8", (False, True))],
                         ids=["auto", "int8", "stacked_to_plain", "plain_to_stacked_int8"])
def test_rows_arrive_bit_for_bit(kv_dtype, scan):
    extra = {"engine.kv_cache_dtype": kv_dtype}
    src = make(16, **extra, **{"engine.scan_layers": scan[0]})
    dst = make(8, **extra, **{"engine.scan_layers": scan[1]})
    info = prefill(src)
    held = next(iter(src.kv_handoff.held.values()))
    want = rows(src, held.pages, 44)
    arrays, n = dst.enable_kv_transfer().pull(info, PROMPT)
    assert n == 44 and kvt.wait_ready(arrays, time.monotonic() + 30)
    dst.add_prefilled_request(PROMPT, SamplingParams(max_tokens=1), "x", arrays, n)
    req = dst.requests["x"]
    got = rows(dst, req.pages, 44)
    for w, g in zip(want, got):
        for a, b in zip(w, g):
            assert not np.isnan(a.astype(np.float32)).any()
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    # Nothing else was written: every other page of the decode pool is still NaN.
    others = [p for p in range(1, dst.settings.num_pages) if p not in req.pages]
    leaf = layers(dst.runner.kv_cache)[-1]
    probe = np.asarray(leaf.scales if isinstance(leaf, QuantizedPages) else leaf)[others]
    assert np.isnan(probe).all()
    # The 45th token's slot (the one the decode side computes itself) is untouched too.
    last = np.asarray(leaf.scales if isinstance(leaf, QuantizedPages) else leaf)[req.pages[44 // 8], 44 % 8]
    assert np.isnan(last).all()


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=12),
                                    SamplingParams(max_tokens=12, temperature=0.9, seed=11, logprobs=2)],
                         ids=["greedy", "seeded"])
def test_decode_continues_like_one_engine(engines, params):
    src, dst = engines
    want = dst.generate([PROMPT], params)[0]
    total = src.stats()["pages_total"]
    info = prefill(src)
    assert src.stats()["pages_free"] == total - 3  # 45 tokens in 16-token pages, kept for the pull
    rid = pull_and_admit(dst, info, PROMPT, params)
    got = run_one(dst, rid)
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    assert_same_logprobs(got.logprobs, want.logprobs)
    assert src.release_held(info["transfer_id"]) and not src.release_held(info["transfer_id"])
    assert src.stats()["pages_free"] == total
    assert dst.stats()["pages_free"] == dst.stats()["pages_total"]
    src.scheduler.replicas[0].bm.check()
    dst.scheduler.replicas[0].bm.check()


def test_unpulled_pages_free_after_timeout():
    src = make(16, **{"engine.kv_transfer_timeout_s": 0.3})
    total = src.stats()["pages_total"]
    info = prefill(src)
    assert src.stats()["pages_free"] == total - 3
    assert src.expire_held() == 0  # not yet
    time.sleep(0.35)
    assert src.expire_held() == 1
    assert src.stats()["pages_free"] == total
    assert not src.release_held(info["transfer_id"])
    # The transfer server dropped the offer too: a late pull never arrives, and the
    # puller's own deadline says so.
    late = make(8)
    arrays, _ = late.enable_kv_transfer().pull(info, PROMPT)
    assert not kvt.wait_ready(arrays, time.monotonic() + 0.5)


def test_offer_for_another_prompt_is_refused(engines):
    src, dst = engines
    info = prefill(src)
    try:
        with pytest.raises(kvt.TransferFailed, match="different prompt"):
            dst.enable_kv_transfer().pull(info, PROMPT[:-2] + [1, 2])
        with pytest.raises(kvt.TransferFailed, match="tokens"):
            dst.enable_kv_transfer().pull(info, PROMPT + [5])
    finally:
        src.release_held(info["transfer_id"])


PREFILL_SCRIPT = r"""
import json, sys
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import QueueFull, SamplingParams
overrides, prompt = json.loads(sys.argv[1]), json.loads(sys.argv[2])
e = Engine.from_config("tiny_random", overrides=overrides, progress=False)
rid = e.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
e.hold_pages(rid)
while e.has_unfinished():
    e.step()
total = e.stats()["pages_total"]
print(json.dumps({"info": e.take_kv_offer(rid), "free": e.stats()["pages_free"], "total": total}), flush=True)
sys.stdin.readline()  # the decode side has pulled
tid = next(iter(e.kv_handoff.held))
print(json.dumps({"released": e.release_held(tid), "free": e.stats()["pages_free"]}), flush=True)
"""


# tensor 4: each of the 2 KV heads repeated twice; sequence 4: the prompt's pages dealt
# over four ranks (context parallelism), gathered into rows for a one-device decode
@pytest.mark.slow
@pytest.mark.parametrize("mesh", [{"mesh.tensor": 2}, {"mesh.tensor": 4}, {"mesh.sequence": 4}],
                         ids=["tensor2", "tensor4", "sequence4"])
def test_prefill_in_another_process_on_another_mesh(engines, mesh):
    """Prefill in a subprocess on 2 or 4 fake CPU devices, decode here on one."""
    _, dst = engines
    params = SamplingParams(max_tokens=10, temperature=0.7, seed=3)
    want = dst.generate([PROMPT], params)[0]
    env = dict(os.environ, XLA_FLAGS=fake_devices(max(mesh.values())))
    over = {**BASE, "engine.page_size": 16, **mesh}
    proc = subprocess.Popen([sys.executable, "-c", PREFILL_SCRIPT, json.dumps(over), json.dumps(PROMPT)],
                            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        first = json.loads(proc.stdout.readline())
        assert first["free"] == first["total"] - 3
        rid = pull_and_admit(dst, first["info"], PROMPT, params, rid="xproc")
        proc.stdin.write("pulled\n")
        proc.stdin.flush()
        second = json.loads(proc.stdout.readline())
        assert second["released"] and second["free"] == first["total"]
    finally:
        proc.stdin.close()
        proc.wait(60)
    got = run_one(dst, rid)
    assert got.token_ids == want.token_ids
    assert dst.stats()["pages_free"] == dst.stats()["pages_total"]


@pytest.mark.slow
def test_admission_respects_the_batch_and_never_leaks_pages(engines):
    """A prefilled request counts against max_num_seqs (QueueFull, so the serving loop
    retries it with its hook), and rows too short for their prompt free what was taken."""
    src, _ = engines
    dst = make(8, **{"engine.max_num_seqs": 1})
    info = prefill(src)
    try:
        arrays, n = dst.enable_kv_transfer().pull(info, PROMPT)
        assert kvt.wait_ready(arrays, time.monotonic() + 30)
        free = dst.stats()["pages_free"]
        blocker = dst.add_request([5, 6, 7], SamplingParams(max_tokens=4))
        dst.step()  # the blocker runs: the only batch slot is taken
        with pytest.raises(QueueFull, match="max_num_seqs"):
            dst.add_prefilled_request(PROMPT, PREFILL_ONLY, "full", arrays, n, 0)
        run_one(dst, blocker)
        extra = arrays[0].shape[1] - n + 1  # one token more than the (padded) rows hold
        with pytest.raises(kvt.TransferFailed, match="hold"):
            dst.add_prefilled_request(PROMPT + [1] * extra, PREFILL_ONLY, "short", arrays, n + extra, 0)
        assert dst.stats()["pages_free"] == free and not dst.requests
    finally:
        src.release_held(info["transfer_id"])


def test_an_expired_offer_leaves_no_entry_behind():
    src = make(16, **{"engine.kv_transfer_timeout_s": 0.1})
    taken = prefill(src)  # takes its offer; its pull is then done
    assert src.release_held(taken["transfer_id"])
    rid = src.add_request(PROMPT, PREFILL_ONLY)  # a second one whose offer nobody takes
    src.hold_pages(rid)
    while src.has_unfinished():
        src.step()
    time.sleep(0.15)
    assert src.expire_held() == 1
    assert src.take_kv_offer(rid) is None and not src.kv_handoff.offers


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_stacked_and_per_layer_caches_move_the_same_rows(kv_dtype):
    """2 stages x 2 entries (layer s*2 + j is row s of entry j): export from either layout
    gives the same [L, T, ...] rows, and an import writes each layer's rows where that
    layer reads them."""
    from jaxfill.engine.config import load_config

    m = load_config("tiny_random").model
    rng = np.random.default_rng(0)
    plain = KVCache.create(m, 6, 4, fill_value=float("nan"), kv_cache_dtype=kv_dtype)
    values = rng.standard_normal((m.num_layers, 8, 2 * m.num_kv_heads, m.head_dim)).astype(np.float32)
    if kv_dtype == "auto":
        scales = None
    else:
        values = np.clip(np.round(values * 40), -127, 127).astype(np.int8)
        scales = rng.uniform(0.5, 2.0, values.shape[:3]).astype(np.float32)
    plain = kv_rows.import_rows(plain, jnp.asarray(values), None if scales is None else jnp.asarray(scales),
                            [3, 1], 7, 4)
    stacked = kv_rows.import_rows(KVCache.create(m, 6, 4, fill_value=float("nan"), kv_cache_dtype=kv_dtype, stages=2),
                              jnp.asarray(values), None if scales is None else jnp.asarray(scales), [3, 1], 7, 4)
    for a, b in zip(layers(plain), layers(stacked)):  # layer by layer, NaN where nothing was written
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
    got = [kv_rows.export_rows(c, [3, 1], 7, 4, m.num_kv_heads) for c in (plain, stacked)]
    for (v, s) in got:
        np.testing.assert_array_equal(np.asarray(v)[:, :7], values[:, :7])
        if scales is not None:
            np.testing.assert_array_equal(np.asarray(s)[:, :7], scales[:, :7])


MLA = {"model.architecture": "DeepseekV3ForCausalLM", "model.num_kv_heads": 1, "model.head_dim": 48,
       "model.rotary_dim": 16, "model.kv_lora_rank": 32, "model.q_lora_rank": 40, "model.qk_nope_head_dim": 16,
       "model.qk_rope_head_dim": 16, "model.v_head_dim": 24, "model.rope_interleave": True}


@pytest.mark.slow
def test_latent_rows_move_and_decode_continues_like_one_engine():
    """Disaggregated prefill of a multi-head latent attention model (models/mixers/mla.py): the
    latent "head" rows cross, and the decode side's tokens and logprobs are one engine's."""
    src = make(16, **MLA, **{"engine.kv_transfer_timeout_s": 60})
    dst = make(8, **MLA)
    assert dst.stats()["kv_bytes_per_token"] == src.config.model.num_layers * 48 * 4  # the latent, once
    params = SamplingParams(max_tokens=10, temperature=0.9, seed=3, logprobs=2)
    want = dst.generate([PROMPT], params)[0]
    info = prefill(src)
    got = run_one(dst, pull_and_admit(dst, info, PROMPT, params))
    assert got.token_ids == want.token_ids
    assert_same_logprobs(got.logprobs, want.logprobs)
    assert src.release_held(info["transfer_id"])
    assert dst.stats()["pages_free"] == dst.stats()["pages_total"]
