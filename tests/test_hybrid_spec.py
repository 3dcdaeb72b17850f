"""Speculative decoding on linear-attention hybrids (engine/scheduler/verification.py): a
verification advances the recurrent state over every proposal, so after a rejection the
state goes back to the copy taken before the step and the accepted rows are replayed.

Greedy output with n-gram / suffix proposals equals output without, token for token, for a
Gated DeltaNet hybrid (Qwen3.5), Mamba2 hybrids (Granite 4.0-H; Falcon-H1, whose layers run
attention beside Mamba2, in the slow set), LFM2 (short convolutions) and Kimi Linear (Kimi
Delta Attention, slow set), on self-repeating
prompts (proposals from the first decode) with chunked prefill, async scheduling and state
snapshots (prefix caching); the counters show proposals both accepted and rejected (so a
state that kept a rejected row would change the tokens: the check can fail). Every page
and state slot comes back after finishing and after aborts mid-decode; Qwen3.5 also at
mesh.tensor = 2 (slow set). Unused pages and slots are NaN-filled.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from hf_models import make_hf_checkpoint
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
from fast_engine import REFERENCE_ATTENTION
from xla_flags import fake_devices

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
BASE = {**REFERENCE_ATTENTION,  # tests/fast_engine.py
        "engine.max_num_batched_tokens": 16, "engine.token_buckets": [16], "engine.num_pages": 160,
        "engine.page_size": 8, "engine.max_model_len": 160, "engine.max_num_seqs": 3,
        "engine.kv_fill_value": float("nan"), "engine.state_snapshot_tokens": 16, "engine.state_snapshot_slots": 32,
        "engine.async_scheduling": True}
NGRAM = {"speculative.method": "ngram", "speculative.num_tokens": 3, "speculative.ngram_max": 3,
         "speculative.ngram_min": 1, "speculative.backoff_window": 0}


@pytest.fixture(scope="module", params=[
    "qwen3_5", "granitemoehybrid", "lfm2",
    # nightly (2026-12-07, 2 loaded cores): Falcon-H1 20 s warm, 53 s cold; Kimi Linear 26 s
    pytest.param("falcon_h1", marks=pytest.mark.slow), pytest.param("kimi_linear", marks=pytest.mark.slow)])
def checkpoint(request, tmp_path_factory):
    directory = make_hf_checkpoint(str(tmp_path_factory.mktemp("hybrid_spec") / request.param), request.param)
    return directory


def engine(directory, **overrides) -> Engine:
    return Engine.from_config("tiny", model_path=directory, overrides={**BASE, **overrides}, progress=False)


def prompts(vocab: int) -> list[list[int]]:
    """Self-repeating prompts (the n-gram proposer finds matches at once) past a state
    snapshot boundary and the chunk size, two of them sharing their first 20 tokens."""
    rng = np.random.default_rng(5)
    pat = [int(t) for t in rng.integers(0, vocab, 5)]
    other = [int(t) for t in rng.integers(0, vocab, 4)]
    return [pat * 7, pat * 4 + other * 2, pat * 4 + [pat[0]] * 3, other * 5]


def echoing(plain: Engine, n: int = 4) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts p + greedy(p) + p and their greedy tokens: after the second p the n-gram
    proposer proposes greedy(p), which a random model follows for a few tokens (accepted),
    then leaves (rejected)."""
    ps = prompts(plain.config.model.vocab_size)[:n]
    ps = [p + o.token_ids + p for p, o in zip(ps, plain.generate(ps, GREEDY))]
    return ps, [o.token_ids for o in plain.generate(ps, GREEDY)]


def all_back(e: Engine) -> None:
    st = e.stats()
    sch = e.scheduler.replicas[0]
    assert st["pages_free"] == st["pages_total"] and not e.has_unfinished()
    assert sorted(sch.free_slots) == list(range(e.config.engine.state_slots))
    sch.bm.check()


def test_greedy_with_ngram_equals_without(checkpoint):
    # Kimi Linear's random model never follows the echoed tokens: its proposals are all
    # rejected here (its accepted ones: the suffix test)
    check_ngram(checkpoint, accepts=not checkpoint.endswith("kimi_linear"))


def check_ngram(checkpoint, accepts: bool = True, **extra) -> None:
    plain = engine(checkpoint, **extra)
    ps, want = echoing(plain)
    spec = engine(checkpoint, **NGRAM, **extra)
    assert spec.config.engine.state_slots == 2 * plain.config.engine.state_slots  # a second slot each
    assert [o.token_ids for o in spec.generate(ps, GREEDY)] == want
    st = spec.stats()
    assert (st["spec_accepted_tokens"] > 0 or not accepts) and st["spec_state_replays"] > 0, st  # accepted, rejected
    all_back(spec)
    # a second round: prompts resume from state snapshots (prefix caching) and still agree
    hits = st["state_snapshot_hits"]
    assert [o.token_ids for o in spec.generate(ps, GREEDY)] == want
    assert spec.stats()["state_snapshot_hits"] > hits
    all_back(spec)


def test_suffix_proposals_and_aborts_give_every_slot_back(checkpoint):
    plain = engine(checkpoint)
    ps, want = echoing(plain, 2)
    spec = engine(checkpoint, **{**NGRAM, "speculative.method": "suffix", "engine.async_scheduling": False})
    for _ in range(2):  # the second round also proposes the first round's outputs (suffix decoding's cache)
        assert [o.token_ids for o in spec.generate(ps, GREEDY)] == want
    st = spec.stats()
    assert st["spec_accepted_tokens"] > 0 and st["spec_state_replays"] > 0, st
    ids = [spec.add_request(p, GREEDY) for p in ps]
    for _ in range(8):  # into the decodes, some verifying
        spec.step()
    assert spec.stats()["spec_verifications"] > st["spec_verifications"]
    for i in ids:
        spec.abort(i)
    while spec.has_unfinished():
        spec.step()
    all_back(spec)


@pytest.mark.slow  # 40 s (2026-12-07, 2 loaded cores)
def test_tensor2_with_ngram_equals_without(tmp_path):
    """The same on 2 fake CPU devices, heads and state split over mesh.tensor (a subprocess)."""
    directory = make_hf_checkpoint(str(tmp_path / "qwen3_5"), "qwen3_5")
    here = os.path.dirname(os.path.abspath(__file__))
    script = (f"import sys, jax; sys.path.insert(0, {here!r}); import test_hybrid_spec as t; "
              "assert jax.device_count() == 2; "
              f"t.check_ngram({directory!r}, **{{'mesh.tensor': 2}}); print('RESULT ok')")
    env = dict(os.environ, XLA_FLAGS=fake_devices(2))
    proc = subprocess.run([sys.executable, "-c", script], cwd=os.path.dirname(here), env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0 and "RESULT ok" in proc.stdout, proc.stderr[-4000:]
