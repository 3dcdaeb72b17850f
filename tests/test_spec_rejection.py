"""The acceptance rule for a point-mass (n-gram) draft keeps the target distribution.

Each verification row draws y ~ p with the request's sampler (engine/sampler.py); the
rule accepts proposal x iff y == x, else emits y (engine/speculative/acceptance.py).
Over many seeds on a 5-token vocabulary: the acceptance rate is p(x), a rejection emits
p with x removed and renormalised, and every emitted token follows p (chi-square). An
"always accept" rule fails the same check, so the check can fail.
"""

import jax.numpy as jnp
import numpy as np

from jaxfill.engine.sampler import sample
from jaxfill.engine.sampling_rows import empty_sampling
from jaxfill.engine.speculative.acceptance import accept_prefix

V, N, TEMP = 5, 6000, 0.8
LOGITS = np.asarray([1.0, 0.2, 1.6, -0.5, 0.7], np.float32)
TARGET = np.exp(LOGITS.astype(np.float64) / TEMP) / np.exp(LOGITS.astype(np.float64) / TEMP).sum()
PROPOSAL = 2  # the most likely token: accepted about half the time


def target_draws(out_index: int = 0) -> np.ndarray:  # [N] one draw per seed, as the engine's rows make them
    sp = empty_sampling(N, 4, V)
    sp.temperature[:] = TEMP
    sp.seed_lo[:] = np.arange(N, dtype=np.uint32) * 7919 + 1
    sp.out_index[:] = out_index
    return np.asarray(sample(jnp.asarray(np.tile(LOGITS, (N, 1))), sp).tokens)


def engine_rule(y: int, bonus: int) -> int:
    return accept_prefix([PROPOSAL], [y, bonus])[0]


def always_accept(y: int, bonus: int) -> int:
    return PROPOSAL


CRITICAL = {3: 16.27, 4: 18.47}  # chi-square quantiles at p = 0.001 by degrees of freedom


def fits(tokens: np.ndarray,  # [n] emitted tokens
         probs: np.ndarray) -> bool:  # [V] expected distribution
    """Pearson's chi-square test at p = 0.001: the counts could come from `probs`."""
    counts = np.bincount(tokens, minlength=V)
    keep = probs > 0
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    stat = float((((counts[keep] - expected) ** 2) / expected).sum())
    return stat < CRITICAL[int(keep.sum()) - 1]


def emitted(rule) -> np.ndarray:  # [N]
    ys, bonus = target_draws(0), target_draws(1)
    return np.asarray([rule(int(y), int(b)) for y, b in zip(ys, bonus)])


def test_emitted_tokens_follow_the_target_distribution():
    assert fits(emitted(engine_rule), TARGET)


def test_acceptance_rate_is_the_target_probability_and_rejections_renormalise():
    ys = target_draws(0)
    accepted = ys == PROPOSAL
    rate = accepted.mean()
    assert abs(rate - TARGET[PROPOSAL]) < 4 * np.sqrt(TARGET[PROPOSAL] * (1 - TARGET[PROPOSAL]) / N)
    residual = TARGET.copy()
    residual[PROPOSAL] = 0
    residual /= residual.sum()
    rejected = np.asarray([engine_rule(int(y), 0) for y in ys[~accepted]])
    assert PROPOSAL not in rejected
    assert fits(rejected, residual)


def test_a_biased_rule_fails_the_same_check():
    assert not fits(emitted(always_accept), TARGET)
