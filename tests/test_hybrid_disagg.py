"""Disaggregated prefill of a linear-attention hybrid (Qwen3.5's Gated DeltaNet, and
Nemotron-H's Mamba2; random init): the prefill engine ends a held prompt's chunk at
len(prompt) - 1, exports the recurrent state there and offers it after the KV rows; the
decode engine (another page size, NaN-filled pages and slots) writes both into its own
pool and slot and must give exactly the tokens and logprobs of the decode engine doing
the whole request itself, with and without prefix-cache hits on either side. Nothing
leaks: pages and slots come back."""

import time

import pytest

from hf_models import make_hf_checkpoint
from jaxfill.engine.disagg import transfer as kvt
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
from test_kv_transfer import assert_same_logprobs, run_one
from fast_engine import REFERENCE_ATTENTION

BASE = {**REFERENCE_ATTENTION,  # tests/fast_engine.py
        "engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64], "engine.num_pages": 64,
        "engine.max_model_len": 128, "engine.max_num_seqs": 3, "engine.kv_fill_value": float("nan"),
        "engine.state_snapshot_tokens": 16}
PREFILL_ONLY = SamplingParams(max_tokens=1, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=8, temperature=0.9, seed=3, logprobs=2, ignore_eos=True)


def make_engines(tmp_path_factory, arch: str, **extra) -> tuple[Engine, Engine]:
    """The prefill engine (16-token pages) and the decode engine (8-token pages)."""
    directory = make_hf_checkpoint(str(tmp_path_factory.mktemp("hybrid_disagg") / arch), arch)
    make = lambda page, **more: Engine.from_config("tiny", model_path=directory, progress=False,  # noqa: E731
                                                   overrides={**BASE, "engine.page_size": page, **extra, **more})
    return make(16, **{"engine.kv_transfer_timeout_s": 60}), make(8)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    return make_engines(tmp_path_factory, "qwen3_5")


def all_back(e: Engine) -> bool:
    st, sch = e.stats(), e.scheduler.replicas[0]
    return st["pages_free"] == st["pages_total"] and len(sch.free_slots) == e.config.engine.state_slots


def move(src: Engine, dst: Engine, prompt: list[int], rid: str):
    """Prefill on src (held), pull into dst, run it there: the completion."""
    pid = src.add_request(prompt, PREFILL_ONLY)
    src.hold_pages(pid)
    while src.has_unfinished():
        src.step()
    info = src.take_kv_offer(pid)
    assert info is not None and len(info["arrays"]) == 3  # rows, recurrent states, conv histories
    arrays, n = dst.enable_kv_transfer().pull(info, prompt)
    assert kvt.wait_ready(arrays, time.monotonic() + 30)
    dst.add_prefilled_request(prompt, SAMPLED, rid, arrays, n, info["cached_tokens"])
    done = run_one(dst, rid)
    assert src.release_held(info["transfer_id"])
    return done, info


@pytest.mark.parametrize("length", [45, 33, 17, 2])
def test_decode_continues_like_one_engine(engines, length):
    """Prompts whose held chunk ends inside a page, on a snapshot boundary (33 - 1 = 32),
    one past one, and a one-row prompt."""
    src, dst = engines
    prompt = [(7 * i + 3) % 250 for i in range(length)]
    want = dst.generate([prompt], SAMPLED)[0]
    got, _ = move(src, dst, prompt, f"d{length}")
    assert got.token_ids == want.token_ids
    assert_same_logprobs(got.logprobs, want.logprobs)
    assert all_back(src) and all_back(dst)


def test_prefix_hits_on_both_sides(engines):
    """A second prompt sharing 40 tokens: the prefill side resumes from its snapshot at 32,
    the decode side from its own; the state sent is still the one at len(prompt) - 1."""
    src, dst = engines
    root = [(5 * i + 1) % 250 for i in range(40)]
    first, second = root + [9, 8, 7], root + [1, 2, 3, 4, 5, 6]
    for i, prompt in enumerate((first, second)):
        want = dst.generate([prompt], SAMPLED)[0]
        got, info = move(src, dst, prompt, f"p{i}")
        assert got.token_ids == want.token_ids
        assert_same_logprobs(got.logprobs, want.logprobs)
    assert info["cached_tokens"] == 32 and src.stats()["state_snapshot_hits"] > 0
    assert all_back(src) and all_back(dst)


ONE_BUCKET = {"engine.max_num_batched_tokens": 16, "engine.token_buckets": [16]}  # one step program: half the compiles


def test_nemotron_h_mamba2_state_moves_too(tmp_path_factory):
    """Nemotron-H (Mamba2's [H, N, P] states and group-by-group conv histories): a prompt
    ending inside a page, then one sharing its first 40 tokens, so both sides resume
    from their snapshots at 32."""
    check_snapshot_handoff(tmp_path_factory, "nemotron_h")


def check_snapshot_handoff(tmp_path_factory, arch: str) -> None:
    """A prompt ending inside a page, then one sharing its first 40 tokens: both hand-offs
    resume from the snapshots at 32 and decode like the decode engine alone."""
    src, dst = make_engines(tmp_path_factory, arch, **ONE_BUCKET)
    root = [(5 * i + 1) % 250 for i in range(40)]
    for i, prompt in enumerate((root + [9, 8, 7, 6, 5], root + [1, 2, 3])):
        want = dst.generate([prompt], SAMPLED)[0]
        got, info = move(src, dst, prompt, f"{arch}{i}")
        assert got.token_ids == want.token_ids
        assert_same_logprobs(got.logprobs, want.logprobs)
    assert info["cached_tokens"] == 32 and src.stats()["state_snapshot_hits"] > 0
    assert all_back(src) and all_back(dst)
