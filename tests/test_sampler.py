"""On-device sampler against NumPy references: distributions (chi-square), penalties, logprobs."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfill.engine.sampler import MAX_LOGPROBS, SamplingArrays, sample

V = 24
sample_jit = jax.jit(sample)


def arrays(s, h=8, vocab=V, **kw):
    base = dict(temperature=np.zeros(s, np.float32), top_k=np.zeros(s, np.int32),
                top_p=np.ones(s, np.float32), min_p=np.zeros(s, np.float32),
                seed_hi=np.zeros(s, np.uint32), seed_lo=np.zeros(s, np.uint32),
                out_index=np.zeros(s, np.int32), repetition_penalty=np.ones(s, np.float32),
                presence_penalty=np.zeros(s, np.float32), frequency_penalty=np.zeros(s, np.float32),
                hist=np.full((s, h), -1, np.int32), want_logprobs=np.zeros(s, bool),
                bias_ids=np.full((s, 4), -1, np.int32), bias_values=np.zeros((s, 4), np.float32),
                allowed=np.full((s, (vocab + 31) // 32), -1, np.int32))
    for k, v in kw.items():
        base[k] = np.broadcast_to(np.asarray(v, base[k].dtype), base[k].shape).copy()
    return SamplingArrays(**base)


def reference_probs(logits, temperature, top_k, top_p, min_p):
    """NumPy: temperature, top-k, top-p on the renormalised top-k, min-p vs the max prob."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = np.zeros(len(z), bool)
    k = top_k or len(z)
    pk = p[order[:k]] / p[order[:k]].sum()
    cum = np.cumsum(pk) - pk
    for rank, tok in enumerate(order[:k]):
        if cum[rank] < top_p and p[tok] >= min_p * p.max():
            keep[tok] = True
    keep[order[0]] = True
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def chi2_threshold(df, z=3.719):  # z: one-sided 1e-4 normal quantile (Wilson-Hilferty)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def draws(logits, n, seed=11, **kw):
    sp = arrays(n, seed_hi=0, seed_lo=seed, out_index=np.arange(n), **kw)
    out = sample_jit(jnp.broadcast_to(jnp.asarray(logits), (n, len(logits))), sp)
    return np.asarray(out.tokens)


LOGITS = np.random.default_rng(0).normal(0, 1.5, V).astype(np.float32)


@pytest.mark.parametrize("cfg", [
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=6, top_p=1.0, min_p=0.0),
    dict(temperature=1.3, top_k=0, top_p=0.8, min_p=0.0),
    dict(temperature=1.0, top_k=10, top_p=0.9, min_p=0.05),
])
def test_distribution_matches_numpy_reference(cfg):
    n = 20000
    toks = draws(LOGITS, n, **cfg)
    ref = reference_probs(LOGITS, **cfg)
    counts = np.bincount(toks, minlength=V)
    assert counts[ref == 0].sum() == 0, "drew a token the filters exclude"
    support = ref > 0
    expected = ref[support] * n
    chi2 = float((((counts[support] - expected) ** 2) / expected).sum())
    df = int(support.sum()) - 1
    assert df >= 1
    assert chi2 < chi2_threshold(df), (chi2, chi2_threshold(df), counts, np.round(expected))


def test_chi2_catches_a_wrong_distribution():
    """The same statistic rejects draws from a different temperature (the test can fail)."""
    n = 20000
    toks = draws(LOGITS, n, temperature=1.0)
    ref = reference_probs(LOGITS, 0.7, 0, 1.0, 0.0)
    counts = np.bincount(toks, minlength=V)
    chi2 = float((((counts - ref * n) ** 2) / (ref * n)).sum())
    assert chi2 > chi2_threshold(V - 1)


def test_seeded_rows_independent_of_batch_and_neighbours():
    logits = jnp.asarray(np.random.default_rng(1).normal(0, 1, (4, V)).astype(np.float32))
    sp = arrays(4, temperature=[1.0, 0.0, 0.5, 2.0], top_k=[0, 0, 5, 0], seed_lo=[1, 2, 3, 4],
                out_index=[7, 0, 3, 9])
    batched = np.asarray(sample_jit(logits, sp).tokens)
    for i in range(4):
        one = arrays(1, temperature=[sp.temperature[i]], top_k=[sp.top_k[i]], seed_lo=[sp.seed_lo[i]],
                     out_index=[sp.out_index[i]])
        assert int(sample_jit(logits[i:i + 1], one).tokens[0]) == batched[i]
    assert batched[1] == int(jnp.argmax(logits[1]))
    # Different seeds or output indices give different streams.
    a = draws(LOGITS, 64, seed=1, temperature=1.0)
    b = draws(LOGITS, 64, seed=2, temperature=1.0)
    assert (a != b).sum() > 10


def test_penalties_match_numpy():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 2, (3, V)).astype(np.float32)
    h = 8
    hist = np.full((3, h), -1, np.int32)
    out_toks = [[1, 1, 4], [2, 5], [7]]
    prompt_toks = [[9, 10], [3], [11, 12, 13]]
    for i in range(3):
        row = out_toks[i] + [t + V for t in prompt_toks[i]]
        hist[i, :len(row)] = row
    rp, pp, fp = [1.5, 1.0, 2.0], [0.0, 0.8, 0.3], [0.5, 0.0, 1.0]
    sp = arrays(3, h=h, repetition_penalty=rp, presence_penalty=pp, frequency_penalty=fp)
    sp = SamplingArrays(**{**sp.__dict__, "hist": hist})
    got = np.asarray(sample_jit(jnp.asarray(logits), sp).tokens)
    for i in range(3):
        z = logits[i].astype(np.float64).copy()
        seen = set(out_toks[i]) | set(prompt_toks[i])
        for t in seen:
            z[t] = z[t] / rp[i] if z[t] > 0 else z[t] * rp[i]
        for t in set(out_toks[i]):
            z[t] -= fp[i] * out_toks[i].count(t) + pp[i]
        assert got[i] == int(np.argmax(z))
    # Strong penalties really move the argmax.
    top = int(np.argmax(logits[0]))
    hist2 = np.full((1, h), -1, np.int32)
    hist2[0, 0] = top
    sp2 = SamplingArrays(**{**arrays(1, h=h, frequency_penalty=2.0, presence_penalty=2.0).__dict__, "hist": hist2})
    assert int(sample_jit(jnp.asarray(logits[:1]), sp2).tokens[0]) != top


def test_logprobs_chosen_and_top_n():
    logits = jnp.asarray(np.random.default_rng(4).normal(0, 1, (2, V)).astype(np.float32))
    out = sample_jit(logits, arrays(2, temperature=[0.0, 1.0], seed_lo=5, want_logprobs=True))
    ref = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float64) if jax.config.x64_enabled else logits))
    for i in range(2):
        t = int(out.tokens[i])
        np.testing.assert_allclose(float(out.logprob[i]), ref[i, t], rtol=1e-5, atol=1e-6)
        order = np.argsort(-ref[i])[:MAX_LOGPROBS]
        np.testing.assert_array_equal(np.asarray(out.top_ids[i]), order)
        np.testing.assert_allclose(np.asarray(out.top_logprobs[i]), ref[i, order], rtol=1e-5, atol=1e-6)


def test_logit_bias_and_masks_move_only_their_rows_and_keep_raw_logprobs():
    """Row 0: +30 on token 5 makes it the greedy pick; row 1: -inf on its argmax (a
    min_tokens mask) makes the runner-up win; row 2: no bias, unchanged. Logprobs are the
    raw model's, bias or not."""
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.standard_normal((3, V)).astype(np.float32))
    top2 = np.argsort(-np.asarray(logits), axis=1)[:, :2]
    ids = np.full((3, 4), -1, np.int32)
    vals = np.zeros((3, 4), np.float32)
    ids[0, 0], vals[0, 0] = 5, 30.0
    ids[1, :2], vals[1, :2] = [top2[1, 0], top2[1, 0]], [-np.inf, 2.0]  # a repeated id: the mask still wins
    out = sample_jit(logits, arrays(3, bias_ids=ids, bias_values=vals, want_logprobs=True))
    assert out.tokens.tolist() == [5, top2[1, 1], top2[2, 0]]
    raw = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(np.asarray(out.logprob), raw[np.arange(3), out.tokens], rtol=1e-6)
    none = sample_jit(logits, arrays(3, want_logprobs=True))
    assert none.tokens.tolist() == top2[:, 0].tolist()


def _packed(allowed_rows, s):
    """Bool rows [s, V] -> the sampler's packed int32 words."""
    words = np.zeros((s, (V + 31) // 32 * 32), np.uint8)
    words[:, :V] = allowed_rows
    return np.packbits(words, axis=-1, bitorder="little").view(np.int32)


def test_grammar_mask_restricts_constrained_rows_only():
    """Row 0 may draw only {3, 7, 20}; row 1 is unconstrained and draws what it would alone."""
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(2, V)).astype(np.float32)
    ok = np.ones((2, V), bool)
    ok[0] = False
    ok[0, [3, 7, 20]] = True
    for seed in range(40):
        sp = arrays(2, temperature=1.0, seed_lo=seed, allowed=_packed(ok, 2))
        out = sample_jit(jnp.asarray(logits), sp)
        alone = sample_jit(jnp.asarray(logits[1:]), arrays(1, temperature=1.0, seed_lo=seed))
        assert int(out.tokens[0]) in (3, 7, 20)
        assert int(out.tokens[1]) == int(alone.tokens[0])
    greedy = sample_jit(jnp.asarray(logits), arrays(2, allowed=_packed(ok, 2), want_logprobs=True))
    assert int(greedy.tokens[0]) == [3, 7, 20][int(np.argmax(logits[0, [3, 7, 20]]))]
    # logprobs (computed when a row asks for them) stay the raw model's
    np.testing.assert_allclose(float(greedy.logprob[0]),
                               jax.nn.log_softmax(logits[0])[int(greedy.tokens[0])], rtol=1e-6)


def test_grammar_mask_wins_over_a_bias_that_leaves_nothing():
    """min_tokens masks the EOS (token 5) that the grammar alone allows: the grammar wins."""
    logits = np.linspace(-1, 1, V, dtype=np.float32)[None]
    ok = np.zeros((1, V), bool)
    ok[0, 5] = True
    sp = arrays(1, allowed=_packed(ok, 1))
    sp = SamplingArrays(**{**sp.__dict__, "bias_ids": np.asarray([[5, -1, -1, -1]], np.int32),
                           "bias_values": np.asarray([[-np.inf, 0, 0, 0]], np.float32)})
    assert int(sample_jit(jnp.asarray(logits), sp).tokens[0]) == 5
