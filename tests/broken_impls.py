"""Attention impls for the warm-up check (tests/test_impl_check.py puts them in IMPLS): two
that fail it, and one that passes (the engine skips the check for `reference` itself)."""

import functools

import jax.numpy as jnp

from jaxfill.pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from jaxfill.pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu
from jaxfill.pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla

# The Mosaic TPU kernel compiled for real (no interpreter) off TPU: a genuine lowering error.
mosaic_off_tpu = functools.partial(ragged_paged_attention_tpu, interpret=False)


def rows_shifted(*args, **kw):  # [T, Hq, D]: finite, plausible, each row gets its neighbour's output
    return jnp.roll(ragged_paged_attention_xla(*args, **kw), 1, axis=0)


def reference_twin(*args, **kw):  # [T, Hq, D]: a correct impl under another name
    return ragged_paged_attention_reference(*args, **kw)
