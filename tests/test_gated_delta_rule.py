"""The gated delta rule (pallas_kernels/gated_delta_rule.py) against a float64 NumPy
oracle of the plain per-token recurrence, on ragged batches: a long prefill chunk, a
short one, two decodes and padding rows, each sequence resuming from its own state;
decodes between chunks beside a fresh (zero-state) prefill; decodes only. Padding rows
and the unused state slot hold NaN. Chunked == recurrent == oracle for chunk sizes 1 to
64; decodes never go through the chunk loop (a decode-only step runs no chunk)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfill.pallas_kernels import gated_delta_rule as gdr
from jaxfill.pallas_kernels.gated_delta_rule import (chunk_table, gated_delta_rule_chunked,
                                                    gated_delta_rule_recurrent)
from scan_checks import check_against_oracle

H, K, V = 2, 8, 6
LENS = [37, 5, 1, 1]  # a chunk, a short chunk, two decodes; a 5th slot unused
PAD = 3
BATCHES = {  # lens, the sequences that start fresh (zero state, as models/linear_slots.py reads them)
    "chunks_then_decodes": (LENS, ()),
    "decodes_between_chunks": ([1, 20, 1, 1, 9, 1], (4,)),  # a decode at row 0, a continuing chunk, a fresh prefill
    "decodes_only": ([1] * 5, ()),
}


def inputs(rng, lens=LENS, fresh=()):
    t = sum(lens) + PAD
    q = rng.standard_normal((t, H, K)) / np.sqrt(K)
    k = rng.standard_normal((t, H, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)  # as Gated DeltaNet's layers give it (l2-normalised)
    v = rng.standard_normal((t, H, V))
    g = -rng.uniform(0.0, 0.5, (t, H))
    beta = rng.uniform(0.0, 1.0, (t, H))
    states = rng.standard_normal((len(lens) + 1, H, K, V))
    for x in (q, k, v, g, beta):
        x[sum(lens):] = np.nan
    states[list(fresh)] = 0.0
    states[-1] = np.nan
    cu = np.concatenate([[0], np.cumsum(lens), [sum(lens)]]).astype(np.int32)
    return q, k, v, g, beta, states, cu


def oracle(q, k, v, g, beta, states, cu):  # float64, token by token; the last sequence is the empty unused one
    lens = np.diff(cu)[:-1]
    out = np.zeros((sum(lens), H, V))
    final = states.copy()
    for s, n in enumerate(lens):
        st = states[s].astype(np.float64).copy()
        for t in range(cu[s], cu[s] + n):
            st = st * np.exp(g[t])[:, None, None]
            delta = beta[t][:, None] * (v[t] - np.einsum("hkv,hk->hv", st, k[t]))
            st = st + k[t][:, :, None] * delta[:, None, :]
            out[t] = np.einsum("hkv,hk->hv", st, q[t])
        final[s] = st
    return out, final


def run(fn, q, k, v, g, beta, states, cu, num_seqs=None, **kw):  # default: all but the last (empty, unused) sequence
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    num_seqs = len(cu) - 2 if num_seqs is None else num_seqs
    o, st = fn(f32(q), f32(k), f32(v), f32(g), f32(beta), jnp.asarray(cu), jnp.asarray([num_seqs], np.int32),
               f32(states), **kw)
    return np.asarray(o), np.asarray(st)


check = check_against_oracle


CASES = [(c, "chunks_then_decodes") for c in (None, 1, 7, 16, 64)] + [
    (c, b) for b in ("decodes_between_chunks", "decodes_only") for c in (None, 7)]


@pytest.mark.parametrize("chunk,batch", CASES,
                         ids=lambda x: "recurrent" if x is None else f"chunk{x}" if isinstance(x, int) else x)
def test_equals_the_float64_recurrence(chunk, batch):
    args = inputs(np.random.default_rng(0), *BATCHES[batch])
    if chunk is None:
        got = run(gated_delta_rule_recurrent, *args)
    else:
        got = run(gated_delta_rule_chunked, *args, chunk=chunk)
    check(*got, *oracle(*args))


def test_decodes_never_reach_the_chunk_loop(monkeypatch):
    """With the chunk step poisoned (NaN out, NaN state), a decode-only step still equals
    the oracle: it ran no chunk. In a mixed step the decodes stay exact while the chunked
    sequences turn NaN (the poison works)."""
    def poisoned(state, q, k, v, g, beta):
        return jnp.full((q.shape[0],) + v.shape[1:], jnp.nan), jnp.full_like(state, jnp.nan)

    monkeypatch.setattr(gdr, "_chunk", poisoned)
    wrapped = gdr.gated_delta_rule_chunked.__wrapped__  # in a new function: traced anew (poisoned), not from the cache
    fn = jax.jit(lambda *a, chunk: wrapped(*a, chunk=chunk), static_argnames="chunk")
    args = inputs(np.random.default_rng(2), *BATCHES["decodes_only"])
    check(*run(fn, *args, chunk=16), *oracle(*args))

    lens, fresh = BATCHES["decodes_between_chunks"]
    args = inputs(np.random.default_rng(2), lens, fresh)
    o, st = run(fn, *args, chunk=16)
    want_o, want_states = oracle(*args)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    one = np.asarray(lens) == 1
    np.testing.assert_allclose(o[starts[one]], want_o[starts[one]], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(st[:len(lens)][one], want_states[:len(lens)][one], rtol=1e-4, atol=1e-4)
    assert np.isnan(o[starts[~one]]).all() and np.isnan(st[:len(lens)][~one]).all()


def test_chunk_table_without_decodes():
    """skip_decodes leaves exactly the one-token sequences out: no chunk at all for a
    decode-only step, so the chunk loop's trip count is zero."""
    for lens, _ in BATCHES.values():
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens), [sum(lens)]]), jnp.int32)
        _, seq, _ = (np.asarray(x) for x in chunk_table(cu, jnp.asarray([len(lens)], np.int32), sum(lens) + PAD, 4,
                                                        skip_decodes=True))
        want = [s for s, n in enumerate(lens) for _ in range(-(-n // 4)) if n > 1]
        assert seq[seq >= 0].tolist() == want


def test_a_sequence_split_over_two_steps_equals_it_whole():
    """Prefill in two calls (the state carried through the slot) == one call: what a
    chunked prefill across engine steps relies on."""
    rng = np.random.default_rng(1)
    q, k, v, g, beta, states, _ = inputs(rng)
    n = LENS[0]
    one = lambda lo, hi, st: run(gated_delta_rule_chunked, q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi],
                                 st, np.asarray([0, hi - lo], np.int32), num_seqs=1, chunk=16)
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
