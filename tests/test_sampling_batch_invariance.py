"""Same seed, same tokens whatever the batch: a row's draw depends on its own logits,
parameters, seed and output index only, never on what its neighbours ask for.

Sampler level: masks, draws and logprobs of a row alone equal (bitwise) those inside
batches of other sizes, at random slots, next to rows that filter heavily and penalize. Engine level (tiny_random, f32, XLA:CPU):
greedy and seeded requests generate the same tokens alone, in a crowded batch, and under
another token budget (other buckets, other prefill chunking).
"""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sampler import arrays as sampler_arrays

from jaxfill.engine.config import load_config
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
from jaxfill.engine.sampler import filter_mask, sample

V = 4096


def arrays(s, **kw):  # test_sampler's, sized for this file's vocabulary (the grammar bitmask)
    return sampler_arrays(s, vocab=V, **kw)
mask_jit = jax.jit(filter_mask)
sample_jit = jax.jit(sample)


def test_unfiltered_row_keeps_every_token_next_to_filtering_rows():
    # Peaked logits: most of the tail has an f32 cumulative probability of exactly 1.
    logits = jnp.asarray(np.random.default_rng(0).normal(0, 8, (3, V)).astype(np.float32))
    sp = arrays(3, temperature=1.0, top_k=[0, 5, 0], top_p=[1.0, 1.0, 0.5])
    mask = np.asarray(mask_jit(logits, sp))
    assert mask[0].all(), f"an unfiltered row kept {mask[0].sum()} of {V} tokens"
    assert mask[1].sum() == 5
    for i in (1, 2):  # filtering rows: same mask alone as in the batch
        one = arrays(1, temperature=1.0, top_k=[sp.top_k[i]], top_p=[sp.top_p[i]])
        np.testing.assert_array_equal(np.asarray(mask_jit(logits[i:i + 1], one))[0], mask[i])


ROW_PARAMS = [  # (temperature, top_k, top_p, min_p)
    (0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.0, 40, 1.0, 0.0),
    (1.0, 0, 0.9, 0.0), (1.3, 50, 0.8, 0.05), (1.0, 0, 1.0, 0.02)]
HEAVY = [(1.0, 1, 1.0, 0.0), (1.0, 0, 0.05, 0.0), (2.0, 0, 1.0, 0.9), (0.5, 3, 0.3, 0.5)]


def _rows(params, seeds, out_index, penalized=None, logits=None, rng=None):
    """`penalized` rows get repetition/frequency penalties, and every row a history of
    its own likeliest tokens (so a penalty reaching the wrong row would move its draw)."""
    t, k, p, m = (list(c) for c in zip(*params))
    n, pen = len(params), np.zeros(len(params), bool) if penalized is None else penalized
    hist = np.full((n, 8), -1)
    if logits is not None:
        hist = np.take_along_axis(np.argsort(-logits, axis=-1)[:, :4], rng.integers(0, 4, (n, 8)), axis=-1)
    return arrays(n, temperature=t, top_k=k, top_p=p, min_p=m, seed_hi=[s >> 32 for s in seeds],
                  seed_lo=[s & 0xFFFFFFFF for s in seeds], out_index=out_index, want_logprobs=True,
                  repetition_penalty=np.where(pen, 1.5, 1.0), frequency_penalty=np.where(pen, 0.5, 0.0),
                  hist=hist)


@pytest.mark.parametrize("batch", [2, 5, 16])
def test_row_draws_alone_equal_draws_in_any_batch(batch):
    rng = np.random.default_rng(batch)
    logits = rng.normal(0, 3, (len(ROW_PARAMS), V)).astype(np.float32)
    seeds = [int(s) for s in rng.integers(0, 2**63, len(ROW_PARAMS))]
    for step in range(6):
        for i, row in enumerate(ROW_PARAMS):
            alone = sample_jit(jnp.asarray(logits[i:i + 1]), _rows([row], [seeds[i]], [step]))
            # The row at a random slot among heavy filterers with their own logits and seeds.
            slot = int(rng.integers(batch))
            params = [HEAVY[j % len(HEAVY)] for j in range(batch)]
            params[slot] = row
            rows = rng.normal(0, 3, (batch, V)).astype(np.float32)
            rows[slot] = logits[i]
            row_seeds = [int(s) for s in rng.integers(0, 2**63, batch)]
            row_seeds[slot] = seeds[i]
            penalized = np.arange(batch) != slot  # neighbours penalize, the row does not
            out = sample_jit(jnp.asarray(rows), _rows(params, row_seeds, [step] * batch, penalized, rows, rng))
            assert int(out.tokens[slot]) == int(alone.tokens[0]), (row, step, batch)
            assert float(out.logprob[slot]) == float(alone.logprob[0])
            np.testing.assert_array_equal(np.asarray(out.top_ids[slot]), np.asarray(alone.top_ids[0]))
            np.testing.assert_array_equal(np.asarray(out.top_logprobs[slot]), np.asarray(alone.top_logprobs[0]))


# ------------------------------------------------------------------ engine level
def make_engine(model, budget, buckets):
    over = {"engine.max_num_batched_tokens": budget, "engine.token_buckets": buckets,
            "engine.num_pages": 64, "engine.max_model_len": 256, "engine.max_num_seqs": 8}
    return Engine(load_config("tiny_random", over), progress=False, model=model)


@pytest.fixture(scope="module")
def engines():
    from jaxfill.engine.loading import build_model

    model = build_model(load_config("tiny_random", {"engine.max_model_len": 256}), progress=False)
    return make_engine(model, 64, [16, 64]), make_engine(model, 32, [16, 32])


TARGETS = [SamplingParams(max_tokens=10, ignore_eos=True, seed=s, temperature=t, top_k=k, top_p=p, min_p=m)
           for s, (t, k, p, m) in zip([11, 22, 33, 44, 55, 66, 77], ROW_PARAMS)]


@pytest.mark.slow
def test_engine_same_tokens_alone_in_a_crowd_and_across_budgets(engines):
    small, other = engines
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (5, 23, 40, 9, 17, 33, 2)]
    alone = [small.generate([p], sp)[0].token_ids for p, sp in zip(prompts, TARGETS)]
    assert len({tuple(a) for a in alone[1:]}) > 1  # sampled rows really differ
    crowd = [[rng.randrange(256) for _ in range(rng.randint(1, 60))] for _ in range(9)]
    crowd_params = [SamplingParams(max_tokens=rng.randint(3, 14), ignore_eos=True, seed=rng.randrange(99),
                                   temperature=t, top_k=k, top_p=p, min_p=m)
                    for t, k, p, m in (HEAVY * 3)[:len(crowd)]]
    for eng in (small, other):
        got = eng.generate(crowd[:4] + prompts + crowd[4:], crowd_params[:4] + TARGETS + crowd_params[4:])
        assert [c.token_ids for c in got[4:4 + len(prompts)]] == alone
