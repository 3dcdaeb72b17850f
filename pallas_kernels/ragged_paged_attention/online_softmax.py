"""The online softmax the XLA impl's loops share, in base 2 (log2(e) is folded into q):
a polynomial exp2 that XLA CPU vectorizes well, the final normalisation (with attention
sinks) and each row's log-sum-exp for merging partial results (context parallelism).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: a fully masked row never makes NaN
LOG2E = math.log2(math.e)


def exp2(x):
    """2**x for x <= 0 in f32: round-to-nearest split + degree-6 polynomial.

    XLA CPU's generic exp goes through extra range handling; this one vectorizes to a
    round, a convert and six FMAs (relative error <= 1e-7 on [-125, 0], tested). Inputs
    below -126 give 2**-126. Do not write the round as (x + 1.5 * 2**23) - 1.5 * 2**23:
    XLA folds that to x.
    """
    x = jnp.maximum(x, -126.0)
    n = lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN)
    f = x - n  # [-0.5, 0.5]
    # Near-minimax (relative error) fit of 2**f on [-0.5, 0.5]: 1.9e-9 before rounding.
    p = jnp.float32(1.5345811606834423e-4)
    p = p * f + jnp.float32(1.3399931216301808e-3)
    p = p * f + jnp.float32(9.6184889585933350e-3)
    p = p * f + jnp.float32(5.5503287769744364e-2)
    p = p * f + jnp.float32(2.4022646890620264e-1)
    p = p * f + jnp.float32(6.9314720573726190e-1)
    p = p * f + jnp.float32(1.0000000005541690)
    scale = lax.bitcast_convert_type((n.astype(jnp.int32) + 127) << 23, jnp.float32)
    return p * scale


def normalize(acc,  # [..., R, D'] f32
               l,  # [..., R] f32 softmax denominator so far
               m,  # [..., R] f32 running max (log2 units)
               sink):  # [Hkv', R] f32 sink logit of each row's head (log2 units), or None
    """The online softmax's output: acc over its denominator, plus the sink term when
    there are sinks. Rows that saw no key (l == 0) have acc == 0 and stay 0.

    The sink term uses jnp.exp2, not the polynomial `exp2`: sink - m may be positive
    (a sink above every score), outside the polynomial's range."""
    if sink is not None:
        return acc / jnp.where(l > 0, l + jnp.exp2(sink - m), 1.0)[..., None]
    return acc / jnp.where(l > 0, l, 1.0)[..., None]


def log_sum_exp(m,  # [..., R] f32 running max (log2 units)
         l):  # [..., R] f32 denominator
    """Natural-log log-sum-exp of a row's scores; -inf for a row that saw no key."""
    return jnp.where(l > 0, (m + jnp.log2(jnp.where(l > 0, l, 1.0))) / LOG2E, -jnp.inf)
