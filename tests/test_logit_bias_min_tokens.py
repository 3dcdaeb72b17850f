"""min_tokens (EOS and stop ids masked until reached), logit_bias and
truncate_prompt_tokens, through the engine with async scheduling on (the default) and off."""

import pytest

from jaxfill import Engine, SamplingParams
from jaxfill.engine.request import InvalidRequest
from fast_engine import REFERENCE_ATTENTION

EOS = 257  # tiny_random's


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def engine(request):
    return Engine.from_config("tiny_random", overrides={**REFERENCE_ATTENTION, "engine.async_scheduling": request.param,
                                                        "engine.max_num_batched_tokens": 64,
                                                        "engine.max_num_seqs": 4}, progress=False)


@pytest.mark.slow
def test_logit_bias_forces_a_token_in_its_own_row_only(engine):
    plain, forced = engine.generate(["hello there", "hello there"],
                                    [SamplingParams(max_tokens=6),
                                     SamplingParams(max_tokens=6, logit_bias={65: 100.0})])
    assert forced.token_ids == [65] * 6
    assert plain.token_ids != forced.token_ids
    assert engine.generate(["hello there"], SamplingParams(max_tokens=6))[0].token_ids == plain.token_ids


def test_min_tokens_masks_eos_and_stop_ids_until_reached(engine):
    eos_now = SamplingParams(max_tokens=10, logit_bias={EOS: 100.0})
    assert engine.generate(["abc"], eos_now)[0].token_ids == [EOS]
    out = engine.generate(["abc"], SamplingParams(max_tokens=10, logit_bias={EOS: 100.0}, min_tokens=4))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == EOS
    assert len(out.token_ids) == 5 and EOS not in out.token_ids[:4]
    stop = SamplingParams(max_tokens=10, logit_bias={70: 100.0}, stop_token_ids=[70], min_tokens=3,
                          temperature=0.8, seed=1)
    out = engine.generate(["abc"], stop)[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == 70 and 70 not in out.token_ids[:3]


def test_truncate_prompt_tokens_keeps_the_last_tokens(engine):
    long = [(11 * i) % 250 + 1 for i in range(5000)]  # over max_model_len (4096)
    cut = engine.generate([long], SamplingParams(max_tokens=5, truncate_prompt_tokens=30))[0]
    alone = engine.generate([long[-30:]], SamplingParams(max_tokens=5))[0]
    assert cut.token_ids == alone.token_ids and cut.prompt_tokens == 30


@pytest.mark.parametrize("params,field", [
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(logit_bias={999: 1.0}), "logit_bias"),
    (dict(logit_bias={5: 101.0}), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
])
def test_bad_values_are_refused_by_name(engine, params, field):
    with pytest.raises(InvalidRequest) as e:
        engine.generate(["abc"], SamplingParams(**params))
    assert e.value.field == field
    st = engine.stats()
    assert st["pages_free"] == st["pages_total"]


def test_logprobs_minus_one_means_all_only_where_the_vocabulary_fits():
    """-1 (every token): a vocabulary of at most 20 tokens (the sampler's top-N); over it,
    refused naming the limit and the model's size."""
    from jaxfill.engine.request import MAX_LOGPROBS_PER_TOKEN

    SamplingParams(logprobs=-1).validate(vocab_size=MAX_LOGPROBS_PER_TOKEN)
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(logprobs=-1).validate(vocab_size=320)
    assert e.value.field == "logprobs" and "at most 20" in str(e.value) and "320" in str(e.value)
    with pytest.raises(InvalidRequest):
        SamplingParams(logprobs=-2).validate(vocab_size=10)
