"""The MTP proposer on linear-attention hybrids (Qwen3.5's, Qwen3.5-MoE's and Qwen3-Next's `mtp.*` block,
models/families/qwen_mtp_tensors.py) through the Engine: the MTP layer runs in every step
(engine/speculative/mtp_step.py) while a rejected verification goes back to the state copied
before it and replays the accepted rows (engine/scheduler/verification.py).

Greedy output with mtp equals output without, token for token, with chunked prefill, async
scheduling and state snapshots (prefix caching) on, and again in a second round that resumes
from the snapshots; the counters show proposals accepted and
rejected and replays after the rejections; every page and state slot comes back. The
sparse ones (MoE MTP layers) run in the slow set. Random MTP
weights almost never guess right, so the block is one that guesses its input token again
(tests/qwen_mtp_checkpoints.py copy_the_input): right where the target repeats a token,
wrong elsewhere. Unused pages and slots are NaN-filled.
"""

import numpy as np
import pytest

from qwen_mtp_checkpoints import make_qwen_mtp_checkpoint
from test_hybrid_spec import BASE, all_back
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams

MTP = {"speculative.method": "mtp", "speculative.num_tokens": 1, "speculative.backoff_window": 0}
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=[
    "qwen3_5",
    # sparse MTP layers (routed experts + gated shared expert); 2026-12-07, 2 loaded cores: 31 s, 23 s
    pytest.param("qwen3_5_moe", marks=pytest.mark.slow), pytest.param("qwen3_next", marks=pytest.mark.slow)])
def copying(request, tmp_path_factory):
    return make_qwen_mtp_checkpoint(str(tmp_path_factory.mktemp("hybrid_mtp") / request.param), request.param,
                                    copying=True)[0]


def engine(directory, **overrides) -> Engine:
    return Engine.from_config("tiny", model_path=directory, overrides={**BASE, **overrides}, progress=False)


def prompts(vocab: int) -> list[list[int]]:
    """Past a snapshot boundary (16) and the chunk (16); two share their first 20 tokens."""
    rng = np.random.default_rng(3)
    shared = [int(t) for t in rng.integers(0, vocab, 20)]
    return [shared + [int(t) for t in rng.integers(0, vocab, 9)], shared + [int(t) for t in rng.integers(0, vocab, 5)],
            [int(t) for t in rng.integers(0, vocab, 37)]]


def test_greedy_with_mtp_equals_without(copying):
    base, eng = engine(copying), engine(copying, **MTP)
    ps = prompts(base.config.model.vocab_size)
    want = [o.token_ids for o in base.generate(ps, GREEDY)]
    got = [o.token_ids for o in eng.generate(ps, GREEDY)]
    assert got == want
    st = eng.stats()
    assert 0 < st["spec_accepted_tokens"] < st["spec_proposed_tokens"]  # some accepted, some rejected
    assert st["spec_state_replays"] > 0  # rejections went back to the state before them
    all_back(eng)
    # a second round: prompts resume from state snapshots (prefix caching), whose MTP K/V
    # pages were written by the first round, and still agree
    hits = st["state_snapshot_hits"]
    assert [o.token_ids for o in eng.generate(ps, GREEDY)] == want
    assert eng.stats()["state_snapshot_hits"] > hits
    all_back(eng)
