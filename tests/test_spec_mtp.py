"""The MTP proposer through the Engine (speculative.method = "mtp", engine/speculative/mtp_step.py).

On a tiny DeepSeek-V3 checkpoint with its MTP layer (tests/mtp_checkpoints.py): greedy
output with MTP equals greedy output without, token for token, with chunked prefill, prefix
caching and async scheduling on; pages all come back; the counters count MTP's proposals.
The proposals are the torch reference MTP's: each request's first proposal (after its
prompt, from the last prompt position with the sampled token) is the argmax of the
reference's logits over the same tokens. Random weights propose badly, so one more engine
gets an MTP layer whose guesses are right (its eh_proj and decoder layer zeroed and its
shared-head norm set so the layer reproduces the target's own next-token guess from the
embedding of a token the target repeats): accepted counts > 0 there.
"""

import numpy as np
import pytest

from mtp_checkpoints import make_mtp_checkpoint, reference
from jaxfill.engine.config import load_config
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
from jaxfill.models.config import ConfigError
from fast_engine import REFERENCE_ATTENTION

OVERRIDES = {**REFERENCE_ATTENTION, "engine.max_num_batched_tokens": 32, "engine.token_buckets": [8, 32],
             "engine.num_pages": 48, "engine.max_model_len": 128, "engine.max_num_seqs": 4, "engine.page_size": 8,
             "engine.long_prefill_token_threshold": 12, "engine.enable_prefix_caching": True,
             "engine.async_scheduling": True, "engine.kv_fill_value": float("nan"),
             "speculative.backoff_window": 0}  # propose every decode, however bad the random guesses
MTP = {"speculative.method": "mtp", "speculative.num_tokens": 1}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_mtp_checkpoint(str(tmp_path_factory.mktemp("mtp_engine") / "dsv3"))


@pytest.fixture(scope="module")
def copying(tmp_path_factory):
    return make_mtp_checkpoint(str(tmp_path_factory.mktemp("mtp_engine") / "copying"), copying=True)


def engine(directory, **extra) -> Engine:
    return Engine(load_config("tiny_random", {**OVERRIDES, **extra}, directory), progress=False)


def prompts(vocab: int):
    rng = np.random.default_rng(7)
    shared = rng.integers(0, vocab, 17).tolist()  # a prefix-cache hit for the second request (2 pages)
    return [shared + rng.integers(0, vocab, 9).tolist(), shared + rng.integers(0, vocab, 4).tolist(),
            rng.integers(0, vocab, 5).tolist()]


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_with_mtp_is_greedy_without(checkpoint, copying, overlap):
    """Slow: two engines each (~45 s on the shared 2-core host). `overlap`: the copying layer, with proposals off while 2+ requests run
    (disable_by_batch_size = 2), so those steps overlap (async scheduling) and write MTP K/V
    from in-flight tokens that the last request's later proposals attend over."""
    directory, mtp = copying if overlap else checkpoint
    extra = {"speculative.disable_by_batch_size": 2} if overlap else {}
    base = engine(directory)
    eng = engine(directory, **MTP, **extra)
    ps = prompts(base.config.model.vocab_size)
    params = [SamplingParams(max_tokens=n) for n in ((6, 9, 30) if overlap else (14, 9, 11))]
    want = base.generate(ps, params)
    got = eng.generate(ps, params)
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
    st = eng.stats()
    assert st["spec_proposed_tokens"] > 5 and st["spec_verifications"] == st["spec_proposed_tokens"]
    if overlap:
        assert st["spec_disabled_steps"] > 0 and st["spec_accepted_tokens"] > 0
    assert st["pages_free"] == st["pages_total"]
    for sched in eng.scheduler.replicas:
        sched.bm.check()


@pytest.mark.parametrize("length", [13, 10])
def test_every_guess_is_the_reference_mtp_argmax(checkpoint, copying, length):
    """One request alone, step by step: after each step the guess it keeps (the token at
    position `at`) is the torch reference MTP's argmax at its row at - 2 over the request's
    tokens [0, at). 13 tokens: a 12-token chunk (its last row's next token the prompt's 13th),
    then the last prompt token as a decode that verifies that guess; 10: one chunk whose last
    row takes the sampled token; then decodes verifying the guesses (accepted or not)."""
    directory, mtp = checkpoint if length == 13 else copying  # the copying one accepts (see below)
    eng = engine(directory, **MTP, **{"engine.async_scheduling": False})
    prompt = np.random.default_rng(length).integers(0, eng.config.model.vocab_size, length).tolist()
    eng.add_request(prompt, SamplingParams(max_tokens=16))
    checked = 0
    while eng.has_unfinished():
        running = eng.scheduler.replicas[0].running
        req = running[0] if running else None
        eng.step()
        if req is None or req.finished or req.mtp_draft is None:
            continue
        token, at = req.mtp_draft
        tokens = (prompt + req.output_ids)[:at]
        assert at <= len(prompt) + len(req.output_ids)
        _, ref_logits = reference(mtp, np.asarray(tokens))
        assert token == int(np.argmax(ref_logits[-1])), (at, checked)
        checked += 1
    assert checked >= 4
    if length == 10:
        assert eng.stats()["spec_accepted_tokens"] > 0  # guesses from rows after accepted proposals checked too


def test_a_layer_that_guesses_right_is_accepted(copying):
    """The copying MTP layer (tests/mtp_checkpoints.py copy_the_input) on a target that
    repeats itself: proposals accepted, output unchanged, async scheduling and prefix caching on."""
    directory, _ = copying
    base, eng = engine(directory), engine(directory, **MTP)
    ps = [np.random.default_rng(5).integers(0, 500, 7).tolist() * 3, np.random.default_rng(6).integers(0, 500, 9).tolist()]
    params = [SamplingParams(max_tokens=30), SamplingParams(max_tokens=20)]
    for a, b in zip(base.generate(ps, params), eng.generate(ps, params)):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
    st = eng.stats()
    assert 0 < st["spec_accepted_tokens"] <= st["spec_proposed_tokens"]
    assert st["spec_accepted_per_position"] == [st["spec_accepted_tokens"]]
    assert st["pages_free"] == st["pages_total"]


def test_mtp_without_the_layer_is_refused(tmp_path):
    """config.json without the layer: refused by name before any weight is read; one that
    claims it (transformers' DeepseekV3Config defaults num_nextn_predict_layers to 1) but
    whose weights were stripped: refused by name at load."""
    from hf_models import make_hf_checkpoint
    from jaxfill.models.safetensors_file import CheckpointError

    directory = make_hf_checkpoint(str(tmp_path / "none"), "deepseek_v3", num_nextn_predict_layers=0)
    with pytest.raises(ConfigError, match="num_nextn_predict_layers"):
        load_config("tiny_random", {**OVERRIDES, **MTP}, directory)
    directory = make_hf_checkpoint(str(tmp_path / "stripped"), "deepseek_v3")
    with pytest.raises(ConfigError, match="num_tokens = 1"):
        load_config("tiny_random", {**OVERRIDES, **MTP, "speculative.num_tokens": 2}, directory)
    with pytest.raises(CheckpointError, match="no multi-token-prediction layer"):
        engine(directory, **MTP)
