"""engine.decode_buckets: token buckets below the derived 16, 64, 256, ... so that a decode
of a few rows runs a step of that many rows, not 16 (issue 51, item 2).

The bucket list is what token_buckets / bucket_shapes derive (S <= T, so a 1-token bucket
is also a 1-row sampler and LM head); a lone decode runs in the (1, 1) bucket; and an
engine with decode buckets gives the tokens and logprobs of one without them, greedy and
seeded with penalties, async scheduling on (its in-flight tokens cross buckets), and no
step compiles a program the warm-up did not.
"""

import numpy as np
import pytest

from jaxfill.engine.batch import bucket_shapes, describe_buckets, pick_bucket, token_buckets
from jaxfill.engine.checkpoint_settings import checkpoint_engine
from jaxfill.engine.config import EngineSettings, load_config
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
from jaxfill.models.config import ConfigError
from fast_engine import REFERENCE_ATTENTION

OVERRIDES = {**REFERENCE_ATTENTION,  # tests/fast_engine.py
             "engine.max_num_batched_tokens": 64, "engine.num_pages": 64, "engine.max_model_len": 128,
             "engine.max_num_seqs": 8, "engine.enable_prefix_caching": False}
DECODE = {"engine.decode_buckets": [1, 2, 4]}


def test_bucket_list():
    s = EngineSettings(max_num_batched_tokens=1024, max_num_seqs=64, decode_buckets=(8, 1, 2, 4, 2))
    assert token_buckets(s) == (1, 2, 4, 8, 16, 64, 256, 1024)
    shapes = bucket_shapes(s)
    # S <= T: the decode buckets are as many rows as tokens, so the sampler and LM head too
    assert shapes[:5] == [(1, 1), (2, 2), (4, 4), (8, 8), (16, 16)]
    assert describe_buckets(shapes).startswith("8 step buckets (tokens x seqs): 1x1, 2x2, 4x4, 8x8, 16x16")
    assert pick_bucket(shapes, 1, 1) == (1, 1) and pick_bucket(shapes, 3, 3) == (4, 4)
    assert pick_bucket(shapes, 9, 9) == (16, 16)
    # mesh.sequence = 4 rounds T up: 1, 2 and 4 become one 4-token bucket
    assert [t for t, _ in bucket_shapes(s, multiple_of=4)][:3] == [4, 8, 16]
    # an explicit token_buckets is the whole list; buckets at or past the budget are dropped
    assert token_buckets(EngineSettings(max_num_batched_tokens=64, token_buckets=(16, 64), decode_buckets=(1,))) \
        == (16, 64)
    assert token_buckets(EngineSettings(max_num_batched_tokens=4, decode_buckets=(1, 4, 8))) == (1, 4)
    assert token_buckets(EngineSettings(max_num_batched_tokens=64)) == (16, 64)  # the default adds none


def test_checkpoint_runs_set_them():
    from jaxfill.models.config import ModelConfig

    assert checkpoint_engine(ModelConfig(max_position_embeddings=2048))["decode_buckets"] == [1, 2, 4, 8]


@pytest.mark.parametrize("value", [[0], [2, -1], [1.5], [True], 4, "8"])
def test_bad_values_name_the_field(value):
    with pytest.raises(ConfigError, match="engine.decode_buckets"):
        load_config("tiny_random", {"engine.decode_buckets": value})


@pytest.fixture(scope="module")
def model():
    from jaxfill.engine.loading import build_model

    return build_model(load_config("tiny_random", OVERRIDES), progress=False)


def engine(model, **extra) -> Engine:
    cfg = load_config("tiny_random", {**OVERRIDES, **extra, "engine.kv_fill_value": float("nan")})
    return Engine(cfg, progress=False, model=model)


def run(eng: Engine, prompts, params) -> tuple[list, list[tuple[int, int]]]:
    """Completions, and the bucket of every step run."""
    runner, shapes = eng.core.runner, []
    launch = runner.run

    def recording(batch):
        shapes.append(batch.shape)
        return launch(batch)
    runner.run = recording
    try:
        return eng.generate(prompts, params), shapes
    finally:
        runner.run = launch


def params():
    return [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, logprobs=2),
            SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, seed=5, repetition_penalty=1.3,
                           logprobs=2),
            SamplingParams(max_tokens=7, ignore_eos=True, temperature=0.7, top_k=20, seed=11, logprobs=2)]


def test_decode_buckets_same_tokens(model):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, n).tolist() for n in (11, 5, 23)]
    plain, with_buckets = engine(model), engine(model, **DECODE)
    assert plain.core.runner.shapes == [(16, 8), (64, 8)]
    assert with_buckets.core.runner.shapes == [(1, 1), (2, 2), (4, 4), (16, 8), (64, 8)]
    # the runner's static argument (its hash taken once: engine/step.py StaticGraph) is its graphdef's
    runner = with_buckets.core.runner
    assert runner.static_graph.graphdef is runner.graphdef and hash(runner.static_graph) == hash(runner.graphdef)
    programs = runner.cache_size()  # after both warm-ups: no step below compiles another

    # a lone decode runs 1 row: the prompt's step in 16, every decode step in (1, 1)
    (alone,), shapes = run(with_buckets, prompts[:1], params()[0])
    assert shapes[0] == (16, 8) and set(shapes[1:]) == {(1, 1)}, shapes
    (ref,), ref_shapes = run(plain, prompts[:1], params()[0])
    assert set(ref_shapes) == {(16, 8)}
    assert alone.token_ids == ref.token_ids
    np.testing.assert_allclose([lp["logprob"] for lp in alone.logprobs], [lp["logprob"] for lp in ref.logprobs],
                               rtol=1e-5, atol=1e-6)

    # three requests finishing at 7, 10, 12 tokens: decode steps of 3 (in 4), 2, then 1 rows
    got, shapes = run(with_buckets, prompts, params())
    want, _ = run(plain, prompts, params())
    assert {(4, 4), (2, 2), (1, 1)} <= set(shapes), shapes
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert [[i for i, _ in lp["top"]] for lp in g.logprobs] == [[i for i, _ in lp["top"]] for lp in w.logprobs]
        np.testing.assert_allclose([lp["logprob"] for lp in g.logprobs], [lp["logprob"] for lp in w.logprobs],
                                   rtol=1e-5, atol=1e-6)
    assert runner.cache_size() == programs
