"""The gated delta rule (pallas_kernels/gated_delta_rule.py) against a float64 NumPy
oracle of the plain per-token recurrence, on a ragged batch: a long prefill chunk, a
short one, two decodes and padding rows, each sequence resuming from its own state;
padding rows and the unused state slot hold NaN. Chunked == recurrent == oracle for
chunk sizes 1 to 64."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxfill.pallas_kernels.gated_delta_rule import (chunk_table, gated_delta_rule_chunked,
                                                    gated_delta_rule_recurrent)
from scan_checks import check_against_oracle

H, K, V = 2, 8, 6
LENS = [37, 5, 1, 1]  # a chunk, a short chunk, two decodes; a 5th slot unused
PAD = 3


def inputs(rng):
    t = sum(LENS) + PAD
    q = rng.standard_normal((t, H, K)) / np.sqrt(K)
    k = rng.standard_normal((t, H, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)  # as Gated DeltaNet's layers give it (l2-normalised)
    v = rng.standard_normal((t, H, V))
    g = -rng.uniform(0.0, 0.5, (t, H))
    beta = rng.uniform(0.0, 1.0, (t, H))
    states = rng.standard_normal((len(LENS) + 1, H, K, V))
    for x in (q, k, v, g, beta):
        x[sum(LENS):] = np.nan
    states[-1] = np.nan
    cu = np.concatenate([[0], np.cumsum(LENS), [sum(LENS)]]).astype(np.int32)
    return q, k, v, g, beta, states, cu


def oracle(q, k, v, g, beta, states, cu):  # float64, token by token
    out = np.zeros((sum(LENS), H, V))
    final = states.copy()
    for s, n in enumerate(LENS):
        st = states[s].astype(np.float64).copy()
        for t in range(cu[s], cu[s] + n):
            st = st * np.exp(g[t])[:, None, None]
            delta = beta[t][:, None] * (v[t] - np.einsum("hkv,hk->hv", st, k[t]))
            st = st + k[t][:, :, None] * delta[:, None, :]
            out[t] = np.einsum("hkv,hk->hv", st, q[t])
        final[s] = st
    return out, final


def run(fn, q, k, v, g, beta, states, cu, **kw):
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    o, st = fn(f32(q), f32(k), f32(v), f32(g), f32(beta), jnp.asarray(cu), jnp.asarray([len(LENS)], np.int32),
               f32(states), **kw)
    return np.asarray(o), np.asarray(st)


@pytest.mark.parametrize("chunk", [None, 1, 7, 16, 64], ids=lambda c: "recurrent" if c is None else f"chunk{c}")
def test_equals_the_float64_recurrence(chunk):
    rng = np.random.default_rng(0)
    args = inputs(rng)
    want_o, want_states = oracle(*args)
    if chunk is None:
        o, st = run(gated_delta_rule_recurrent, *args)
    else:
        o, st = run(gated_delta_rule_chunked, *args, chunk=chunk)
    check_against_oracle(o, st, want_o, want_states, LENS, 1e-4)


def test_a_sequence_split_over_two_steps_equals_it_whole():
    """Prefill in two calls (the state carried through the slot) == one call: what a
    chunked prefill across engine steps relies on."""
    rng = np.random.default_rng(1)
    q, k, v, g, beta, states, _ = inputs(rng)
    n = LENS[0]
    one = lambda lo, hi, st: run(gated_delta_rule_chunked, q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi],
                                 st, np.asarray([0, hi - lo], np.int32), chunk=16)
    whole_o, whole_st = one(0, n, states[:1])
    first_o, mid = one(0, 20, states[:1])
    second_o, end = one(20, n, mid)
    np.testing.assert_allclose(np.concatenate([first_o, second_o]), whole_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(end, whole_st, rtol=1e-5, atol=1e-5)


def test_chunk_table_never_mixes_sequences():
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(LENS), [sum(LENS)]]), jnp.int32)
    rows, seq, first = (np.asarray(x) for x in chunk_table(cu, jnp.asarray([len(LENS)], np.int32), sum(LENS) + PAD, 16))
    bounds = np.asarray(cu)
    for r, s, f in zip(rows, seq, first):
        live = r[r >= 0]
        if s < 0:
            assert live.size == 0 and not f
            continue
        assert live.size and (live >= bounds[s]).all() and (live < bounds[s + 1]).all()
        assert f == (live[0] == bounds[s])
    covered = np.sort(rows[rows >= 0])
    assert covered.tolist() == list(range(sum(LENS)))
