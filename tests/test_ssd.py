"""Mamba2's SSD (pallas_kernels/ssd.py) against a float64 NumPy oracle of the plain
per-token recurrence, from the raw projections (softplus, dt_bias, time-step limit,
A = -exp(A_log), groups shared by heads, the D skip), on a ragged batch: a long prefill
chunk, a short one, two decodes and padding rows, each sequence resuming from its own
state; decodes between chunks beside a fresh (zero-state) prefill; decodes only.
Padding rows and the unused state slot hold NaN. Chunked == recurrent == oracle for
chunk sizes 1 to 64; heads decay slowly enough that the initial states and earlier
chunks still count at each sequence's end. Decodes never go through the chunk loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfill.pallas_kernels import ssd
from jaxfill.pallas_kernels.ssd import ssd_chunked, ssd_recurrent, time_steps
from scan_checks import check_against_oracle

H, G, P, N = 4, 2, 6, 8  # heads, groups (2 heads each), head dim, state size
LENS = [37, 5, 1, 1]  # a chunk, a short chunk, two decodes; a 5th slot unused
PAD = 3
BATCHES = {  # lens, the sequences that start fresh (zero state)
    "chunks_then_decodes": (LENS, ()),
    "decodes_between_chunks": ([1, 20, 1, 1, 9, 1], (4,)),  # a decode at row 0, a continuing chunk, a fresh prefill
    "decodes_only": ([1] * 5, ()),
}


def inputs(rng, lens=LENS, fresh=()):
    t = sum(lens) + PAD
    x = rng.standard_normal((t, H, P))
    dt_raw = rng.standard_normal((t, H))
    b = rng.standard_normal((t, G, N)) / np.sqrt(N)
    c = rng.standard_normal((t, G, N)) / np.sqrt(N)
    for arr in (x, dt_raw, b, c):
        arr[sum(lens):] = np.nan
    dt_bias = np.asarray([-2.0, -1.0, 0.0, 0.5])
    a_log = np.log([0.05, 0.2, 0.5, 2.0])  # from slow (state lasts the 37 tokens) to fast decay
    d = rng.standard_normal(H)
    states = rng.standard_normal((len(lens) + 1, H, N, P))
    states[list(fresh)] = 0.0
    states[-1] = np.nan
    cu = np.concatenate([[0], np.cumsum(lens), [sum(lens)]]).astype(np.int32)
    return x, dt_raw, dt_bias, a_log, b, c, d, states, cu


def oracle(x, dt_raw, dt_bias, a_log, b, c, d, states, cu, limit=None):  # float64, token by token
    lo, hi = limit or (0.0, np.inf)
    lens = np.diff(cu)[:-1]  # the last sequence is the empty unused one
    y = np.zeros((sum(lens), H, P))
    final = states.copy()
    a = -np.exp(a_log)
    for s, n in enumerate(lens):
        st = states[s].copy()  # [H, N, P]
        for t in range(cu[s], cu[s] + n):
            for h in range(H):
                g = h // (H // G)
                dt = np.clip(np.log1p(np.exp(dt_raw[t, h] + dt_bias[h])), lo, hi)
                st[h] = np.exp(dt * a[h]) * st[h] + dt * np.outer(b[t, g], x[t, h])
                y[t, h] = st[h].T @ c[t, g] + d[h] * x[t, h]
        final[s] = st
    return y, final


def run(chunk, x, dt_raw, dt_bias, a_log, b, c, d, states, cu, limit=None, num_seqs=None, rule=ssd_chunked):
    f32 = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
    dt = time_steps(f32(dt_raw), f32(dt_bias), limit)
    num_seqs = len(cu) - 2 if num_seqs is None else num_seqs  # all but the empty unused one
    args = (f32(x), dt, -jnp.exp(f32(a_log)), f32(b), f32(c), f32(d), jnp.asarray(cu),
            jnp.asarray([num_seqs], np.int32), f32(states))
    y, st = ssd_recurrent(*args) if chunk is None else rule(*args, chunk=chunk)
    return np.asarray(y), np.asarray(st)


def check(y, st, want_y, want_states):
    check_against_oracle(y, st, want_y, want_states, 1e-5)


CASES = [(c, lim, "chunks_then_decodes") for c in (None, 1, 2, 7, 16, 37, 64) for lim in (None, (0.2, 0.9))] + [
    (c, (0.2, 0.9), b) for b in ("decodes_between_chunks", "decodes_only") for c in (None, 7)]


@pytest.mark.parametrize("chunk,limit,batch", CASES,
                         ids=lambda x: {None: "none", (0.2, 0.9): "limit"}.get(x, str(x)) if not isinstance(x, int)
                         else f"chunk{x}")
def test_equals_the_float64_recurrence(chunk, limit, batch):
    args = inputs(np.random.default_rng(0), *BATCHES[batch])
    check(*run(chunk, *args, limit=limit), *oracle(*args, limit=limit))


def test_decodes_never_reach_the_chunk_loop(monkeypatch):
    """With the chunk step poisoned (NaN out, NaN state), a decode-only step still equals
    the oracle: it ran no chunk. In a mixed step the decodes stay exact while the chunked
    sequences turn NaN (the poison works)."""
    def poisoned(a, d):
        return lambda state, x, dt, b, c: (jnp.full_like(x, jnp.nan), jnp.full_like(state, jnp.nan))

    monkeypatch.setattr(ssd, "_chunk_step", poisoned)
    wrapped = ssd.ssd_chunked.__wrapped__  # in a new function: traced anew (poisoned), not from the cache
    fn = jax.jit(lambda *a, chunk: wrapped(*a, chunk=chunk), static_argnames="chunk")
    args = inputs(np.random.default_rng(2), *BATCHES["decodes_only"])
    check(*run(16, *args, rule=fn), *oracle(*args))

    lens, fresh = BATCHES["decodes_between_chunks"]
    args = inputs(np.random.default_rng(2), lens, fresh)
    y, st = run(16, *args, rule=fn)
    want_y, want_states = oracle(*args)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    one = np.asarray(lens) == 1
    np.testing.assert_allclose(y[starts[one]], want_y[starts[one]], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(st[:len(lens)][one], want_states[:len(lens)][one], rtol=1e-5, atol=1e-5)
    assert np.isnan(y[starts[~one]]).all() and np.isnan(st[:len(lens)][~one]).all()


def test_the_limit_and_the_initial_state_matter():
    """The test data reach the clip, and the slowest head still remembers its initial
    state at the 37-token sequence's end: what the test above would miss otherwise."""
    args = inputs(np.random.default_rng(0))
    x, dt_raw, dt_bias, a_log, b, c, d, states, cu = args
    free, _ = oracle(*args)
    clipped, _ = oracle(*args, limit=(0.2, 0.9))
    assert np.abs(free - clipped).max() > 0.1
    zero_start, _ = oracle(x, dt_raw, dt_bias, a_log, b, c, d, np.zeros_like(states), cu)
    assert np.abs(free[LENS[0] - 1, 0] - zero_start[LENS[0] - 1, 0]).max() > 0.1


def test_a_sequence_split_over_two_steps_equals_it_whole():
    """Prefill in two calls (the state carried through the slot) == one call: what a
    chunked prefill across engine steps relies on."""
    x, dt_raw, dt_bias, a_log, b, c, d, states, _ = inputs(np.random.default_rng(1))
    n = LENS[0]

    def one(lo, hi, st):
        return run(16, x[lo:hi], dt_raw[lo:hi], dt_bias, a_log, b[lo:hi], c[lo:hi], d, st,
                   np.asarray([0, hi - lo], np.int32), num_seqs=1)

    whole_y, whole_st = one(0, n, states[:1])
    first_y, mid = one(0, 20, states[:1])
    second_y, end = one(20, n, mid)
    np.testing.assert_allclose(np.concatenate([first_y, second_y]), whole_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(end, whole_st, rtol=1e-5, atol=1e-5)
