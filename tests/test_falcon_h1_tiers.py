"""Falcon-H1's pages and state slots leaving the engine (every layer a PagesAndState: its
pages move as an attention layer's, its state as a linear layer's): the host KV tier
holds evicted prefixes' pages beside their state snapshots, and later rounds resume from
the host with the tokens of prefix caching off (NaN-filled unused pages and slots); a
disaggregated prefill engine (16-token pages) hands a held prompt's KV rows and state
to a decode engine (8-token pages), which gives the tokens and logprobs of doing the
whole request itself, with prefix hits on both sides. Pages and slots all come back."""

import numpy as np
import pytest

from hf_models import make_hf_checkpoint
from test_hybrid_disagg import check_snapshot_handoff
from test_hybrid_host_tier import TIER, engine, run

ARCH = "falcon_h1"


@pytest.fixture(scope="module")
def falcon(tmp_path_factory):
    return make_hf_checkpoint(str(tmp_path_factory.mktemp("falcon_tiers") / ARCH), ARCH)


@pytest.mark.slow  # 48 s in a full run (2026-12-07, 2 loaded cores)
def test_host_tier_snapshots_resume_like_prefix_caching_off(falcon):
    """Rounds over four 32-token documents (whole, or cut to 19 tokens) with new questions,
    outnumbering a 13-page pool and its two snapshot slots (tests/test_hybrid_host_tier.py)."""
    rng = np.random.default_rng(5)
    ids = lambda n: [int(t) for t in rng.integers(1, 250, n)]  # noqa: E731
    docs = [ids(32) for _ in range(4)]
    prompts = [(docs[i] if (r + i) % 3 else docs[i][:19]) + ids(5) for r in range(3) for i in rng.permutation(4)]
    want = run(engine(falcon, **{"engine.state_snapshot_tokens": 0}), prompts)
    e = engine(falcon, **TIER)
    assert run(e, prompts) == want
    e.runner.kv_offload.flush()
    st = e.stats()
    assert st["host_state_snapshots_restored"] >= 1 and st["host_kv_hits"] >= 1, st
    assert st["pages_free"] == st["pages_total"]
    assert len(e.scheduler.replicas[0].free_slots) == e.config.engine.state_slots


def test_disaggregated_prefill_hands_pages_and_state(tmp_path_factory):
    """A prompt ending inside a page, then one sharing its first 40 tokens, so both sides
    resume from their snapshots at 32."""
    check_snapshot_handoff(tmp_path_factory, ARCH)
