"""The Kimi delta rule (pallas_kernels/kimi_delta_rule.py: KDA, a decay per key channel)
against a float64 NumPy oracle of the plain per-token recurrence, on ragged batches: a
long prefill chunk, a short one, two decodes and padding rows, each sequence resuming
from its own state; decodes between chunks beside a fresh prefill; decodes only. Padding
rows and the unused state slot hold NaN. Chunked == recurrent == oracle for chunk sizes 1
to 64, with decays strong enough (down to -6 per token and channel) that a chunk form
dividing by exp(G) would overflow."""

import numpy as np
import pytest

from jaxfill.pallas_kernels.kimi_delta_rule import kimi_delta_rule_chunked, kimi_delta_rule_recurrent
from scan_checks import check_against_oracle

H, K, V = 2, 8, 6
LENS = [37, 5, 1, 1]  # a chunk, a short chunk, two decodes; a 5th slot unused
PAD = 3
BATCHES = {  # lens, the sequences that start fresh (zero state, as models/linear_slots.py reads them)
    "chunks_then_decodes": (LENS, ()),
    "decodes_between_chunks": ([1, 20, 1, 1, 9, 1], (4,)),
    "decodes_only": ([1] * 5, ()),
}


def inputs(rng, lens=LENS, fresh=()):
    t = sum(lens) + PAD
    q = rng.standard_normal((t, H, K)) / np.sqrt(K)
    k = rng.standard_normal((t, H, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)  # as KDA's layers give it (l2-normalised)
    v = rng.standard_normal((t, H, V))
    # per channel: most decay gently, a few channels hard (exp(-6) per token)
    g = -rng.uniform(0.0, 0.5, (t, H, K)) * np.where(rng.uniform(size=(t, H, K)) < 0.2, 12.0, 1.0)
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
            st = st * np.exp(g[t])[:, :, None]
            delta = beta[t][:, None] * (v[t] - np.einsum("hkv,hk->hv", st, k[t]))
            st = st + k[t][:, :, None] * delta[:, None, :]
            out[t] = np.einsum("hkv,hk->hv", st, q[t])
        final[s] = st
    return out, final


def run(fn, q, k, v, g, beta, states, cu, num_seqs=None, **kw):
    import jax.numpy as jnp

    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    num_seqs = len(cu) - 2 if num_seqs is None else num_seqs
    o, st = fn(f32(q), f32(k), f32(v), f32(g), f32(beta), jnp.asarray(cu), jnp.asarray([num_seqs], np.int32),
               f32(states), **kw)
    return np.asarray(o), np.asarray(st)


CASES = [(c, "chunks_then_decodes") for c in (None, 1, 7, 16, 64)] + [
    (c, b) for b in ("decodes_between_chunks", "decodes_only") for c in (None, 7)]


@pytest.mark.parametrize("chunk,batch", CASES,
                         ids=lambda x: "recurrent" if x is None else f"chunk{x}" if isinstance(x, int) else x)
def test_equals_the_float64_recurrence(chunk, batch):
    args = inputs(np.random.default_rng(0), *BATCHES[batch])
    if chunk is None:
        got = run(kimi_delta_rule_recurrent, *args)
    else:
        got = run(kimi_delta_rule_chunked, *args, chunk=chunk)
    check_against_oracle(*got, *oracle(*args))


def test_a_sequence_split_over_two_steps_equals_it_whole():
    """Prefill in two calls (the state carried through the slot) == one call."""
    q, k, v, g, beta, states, _ = inputs(np.random.default_rng(1))
    n = LENS[0]
    one = lambda lo, hi, st: run(kimi_delta_rule_chunked, q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi],  # noqa: E731
                                 st, np.asarray([0, hi - lo], np.int32), num_seqs=1, chunk=16)
    whole_o, whole_st = one(0, n, states[:1])
    first_o, mid = one(0, 20, states[:1])
    second_o, end = one(20, n, mid)
    np.testing.assert_allclose(np.concatenate([first_o, second_o]), whole_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(end, whole_st, rtol=1e-5, atol=1e-5)
