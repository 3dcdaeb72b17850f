"""Every ragged paged attention impl against the float64 NumPy oracle.

Batches are random and ragged (hypothesis): decode-only, prefill-only and mixed, kv_len
past q_len, lengths on and off page boundaries, padding tokens and padding sequences, and
NaN in every page slot, q row and metadata entry no live token owns. Shapes are bucketed
(fixed T, S, P per config) so each impl compiles a handful of times, not per example.
"""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from attention_cast_orders import bf16_mismatch, cast_order, wrong_orders
from attention_oracle import make_batch, oracle, rel_err
from jaxfill.pallas_kernels import ragged_paged_attention

IMPLS = ["reference", "xla", "pallas_tpu", "pallas_gpu"]
# Interpret mode is slow: fewer examples for the Pallas impls.
EXAMPLES = {"reference": 5, "xla": 15, "pallas_tpu": 4, "pallas_gpu": 4}
TOL = {np.float32: 1e-5, jnp.bfloat16: 8e-3}  # max |out - ref| / max |ref|, exact oracle
# bf16 against the oracle that rounds where the impl does (attention_cast_orders.py).
# Measured over 40 random ragged batches each (reference, xla; 1..300 keys, 5 head
# shapes), 10 each for pallas_tpu / pallas_gpu (interpreted): at most 0.20% (reference),
# 0.52% (xla), 0.07% (tpu), 0.17% (gpu) of live elements differ from it; in
# one-block rows each by one ulp, in multi-block rows up to 70 ulps of small elements. An
# oracle with one rounding site moved (wrong_orders) differs in 26..66% of elements.
BF16_MISMATCH_TOL = 1.5e-2
WRONG_ORDER_MARGIN = 3  # a wrong cast order must differ in > 3x the tolerated fraction

# (num_q_heads, num_kv_heads, head_dim, page_size, dtype, sliding_window, soft_cap)
CONFIGS = [
    (8, 2, 64, 4, np.float32, None, None),  # GQA 4
    (4, 1, 64, 8, np.float32, 5, None),  # MQA, window smaller than a page
    (4, 4, 128, 4, np.float32, None, 20.0),  # MHA, soft cap
    (8, 1, 64, 8, jnp.bfloat16, 13, 30.0),  # GQA 8, bf16, window + cap
]
NUM_TOKENS, NUM_SLOTS, MAX_PAGES = 48, 5, 12  # shape bucket: 4 seqs x <= 48 keys fit


def run(impl, batch, **kw):
    args = [jnp.asarray(a) for a in batch.args()]
    return np.asarray(ragged_paged_attention(*args, impl=impl, **kw).astype(jnp.float32))


def check(impl, batch, dtype, **kw):
    ref, live = oracle(*batch.args(), **kw)
    out = run(impl, batch, **kw)
    assert out.shape == batch.q.shape
    assert np.isfinite(out).all(), "NaN/inf reached an output row"
    err = rel_err(out, ref, live)
    assert err <= TOL[dtype], f"{impl}: rel err {err:.3g} > {TOL[dtype]}"
    if dtype == jnp.bfloat16:
        check_cast_order(impl, batch, out, live, **kw)


def check_cast_order(impl, batch, out, live, *, sm_scale, sliding_window, soft_cap):
    """bf16 out equals the oracle with the impl's cast order on all but a tolerated fraction
    of elements, and every wrong cast order is clearly farther (so the tolerance is tight)."""
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    order = cast_order(impl, batch, sm_scale=sm_scale, soft_cap=soft_cap)
    ref, _ = oracle(*batch.args(), **kw, cast=order)
    rate, ulps = bf16_mismatch(out, ref, live)
    assert rate <= BF16_MISMATCH_TOL, (impl, order, rate, ulps)
    for name, wrong in wrong_orders(order, sm_scale=sm_scale).items():
        bad, _ = oracle(*batch.args(), **kw, cast=wrong)
        if np.array_equal(bad[live], ref[live]):
            continue  # rounds identically on this batch (e.g. q scaled by a power of two)
        bad_rate, _ = bf16_mismatch(out, bad, live)
        assert bad_rate > WRONG_ORDER_MARGIN * BF16_MISMATCH_TOL, (impl, name, bad_rate)


@st.composite
def ragged_seqs(draw, max_tokens=NUM_TOKENS, max_kv=48):
    mode = draw(st.sampled_from(["decode", "prefill", "mixed"]))
    n = draw(st.integers(1, NUM_SLOTS - 1))
    seqs, budget = [], max_tokens
    for _ in range(n):
        if budget <= 0:
            break
        if mode == "decode" or (mode == "mixed" and draw(st.booleans())):
            q_len = 1
            kv_len = draw(st.integers(1, max_kv))
        elif mode == "prefill":
            q_len = draw(st.integers(1, min(budget, max_kv)))
            kv_len = q_len
        else:
            q_len = draw(st.integers(0, min(budget, 20)))
            kv_len = q_len + draw(st.integers(0 if q_len else 1, max_kv - q_len))
        seqs.append((q_len, kv_len))
        budget -= q_len
    return seqs


@pytest.mark.parametrize("impl", IMPLS)
def test_random_ragged_batches(impl):
    @settings(max_examples=EXAMPLES[impl], deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(ragged_seqs(), st.sampled_from(CONFIGS), st.integers(0, 2**16))
    def prop(seqs, config, seed):
        hq, hkv, d, ps, dtype, window, cap = config
        batch = make_batch(seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=ps,
                           dtype=dtype, num_tokens=NUM_TOKENS, num_slots=NUM_SLOTS,
                           max_pages=MAX_PAGES * 8 // ps, num_pages=NUM_SLOTS * MAX_PAGES * 8 // ps,
                           seed=seed)
        check(impl, batch, dtype, sm_scale=d ** -0.5, sliding_window=window, soft_cap=cap)

    prop()


# Deterministic corner cases, each for every impl.
CASES = {
    # name: (seqs, hq, hkv, d, page_size, dtype, window, cap)
    "page_boundaries": ([(8, 8), (1, 16), (3, 17), (4, 15), (1, 1), (2, 9)], 4, 2, 64, 8,
                        np.float32, None, None),
    "decode_only": ([(1, 5), (1, 32), (1, 33), (1, 1)], 8, 2, 64, 8, np.float32, None, None),
    "one_kv_head_gqa_8": ([(9, 20), (1, 7)], 8, 1, 64, 4, np.float32, None, None),
    "gqa_1": ([(9, 20), (1, 7)], 2, 2, 64, 4, np.float32, None, None),
    "head_dim_256_bf16": ([(6, 13), (1, 9)], 4, 2, 256, 4, jnp.bfloat16, None, None),
    "head_dim_128_bf16_cap": ([(6, 13), (2, 30)], 4, 1, 128, 8, jnp.bfloat16, None, 10.0),
    # Several KV blocks per row (xla 256, tpu 512->max_pages, gpu 64 keys): P is rounded
    # against each block's running max; the oracle must follow the online softmax.
    "bf16_multi_block": ([(5, 300), (1, 290), (3, 70)], 4, 2, 64, 16, jnp.bfloat16, None, None),
    "window_and_cap": ([(12, 40), (1, 40)], 4, 2, 64, 4, np.float32, 9, 15.0),
}


def case_batch(seqs, hq, hkv, d, ps, dtype, seed):
    """A deterministic case's batch: 3 padding tokens and one padding sequence slot."""
    total = sum(q for q, _ in seqs)
    return make_batch(seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=ps,
                      dtype=dtype, num_tokens=total + 3, num_slots=len(seqs) + 1, seed=seed)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_corner_cases(impl, case):
    seqs, hq, hkv, d, ps, dtype, window, cap = CASES[case]
    batch = case_batch(seqs, hq, hkv, d, ps, dtype, seed=7)
    check(impl, batch, dtype, sm_scale=d ** -0.5, sliding_window=window, soft_cap=cap)


@pytest.mark.parametrize("impl", IMPLS)
def test_long_context_window(impl):
    """Positions past 32767 (int16 would wrap) with a sliding window whose first KV block
    is far from 0; plus one sequence attending to all of its 33k keys (xla/reference)."""
    ps = 256
    seqs = [(3, 33_000), (1, 32_770)]
    batch = make_batch(seqs, num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=ps,
                       num_tokens=6, num_slots=3, seed=3)
    check(impl, batch, np.float32, sm_scale=0.125, sliding_window=700)
    if impl in ("xla", "reference"):
        check(impl, batch, np.float32, sm_scale=0.125)


# Attention sinks (gpt-oss): one learned logit per q head in every row's softmax
# denominator. Sinks from -3 to +6 nats: some below every score, some far above (then a
# row's weights sum well under 1, and an impl that drops or misplaces the term is off by
# far more than the tolerance; checked below against the no-sink oracle).
SINK_CASES = {
    # name: (seqs, hq, hkv, d, page_size, dtype, window, cap)
    "gqa4_mixed": ([(9, 20), (1, 7), (5, 5), (1, 33)], 8, 2, 64, 4, np.float32, None, None),
    "window_cap": ([(12, 40), (1, 40)], 4, 2, 64, 4, np.float32, 9, 15.0),
    "bf16_multi_block": ([(5, 300), (1, 290), (3, 70)], 4, 2, 64, 16, jnp.bfloat16, None, None),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", sorted(SINK_CASES))
def test_attention_sinks(impl, case):
    seqs, hq, hkv, d, ps, dtype, window, cap = SINK_CASES[case]
    batch = case_batch(seqs, hq, hkv, d, ps, dtype, seed=11)
    sinks = np.linspace(-3.0, 6.0, hq).astype(np.float32)[np.random.default_rng(0).permutation(hq)]
    kw = dict(sm_scale=d ** -0.5, sliding_window=window, soft_cap=cap)
    ref, live = oracle(*batch.args(), **kw, sinks=sinks)
    plain, _ = oracle(*batch.args(), **kw)
    assert rel_err(plain, ref, live) > 20 * TOL[dtype], "sinks too small to test anything"
    out = run(impl, batch, **kw, sinks=jnp.asarray(sinks))
    assert np.isfinite(out).all(), "NaN/inf reached an output row"
    err = rel_err(out, ref, live)
    assert err <= TOL[dtype], f"{impl}: rel err {err:.3g} > {TOL[dtype]}"


def test_sinks_shape_is_checked():
    batch = make_batch([(3, 5)], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=4)
    with pytest.raises(ValueError, match="sinks must be"):
        run("xla", batch, sm_scale=0.125, sinks=jnp.zeros((2,), jnp.float32))
