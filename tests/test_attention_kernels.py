"""Kernel-level properties beyond oracle parity: impl resolution, race freedom of the TPU
kernel under the TPU interpreter, and that work outside the causal/window range is
skipped (not computed and masked), for every blocked impl."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attention_oracle import make_batch, oracle, rel_err
from jaxfill.pallas_kernels import IMPLS, ragged_paged_attention, resolve_impl
from jaxfill.pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu
from jaxfill.pallas_kernels.ragged_paged_attention.tpu import (interpret_params, races_found,
                                                       ragged_paged_attention_tpu)
from jaxfill.pallas_kernels.ragged_paged_attention.work_items import work_items
from jaxfill.pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla

BLOCKED = {"xla": ragged_paged_attention_xla, "pallas_tpu": ragged_paged_attention_tpu,
           "pallas_gpu": ragged_paged_attention_gpu}


def test_resolve_impl(monkeypatch):
    assert set(IMPLS) == {"reference", "xla", "pallas_tpu", "pallas_gpu", "mosaic_gpu"}
    monkeypatch.delenv("JAXFILL_ATTENTION_IMPL", raising=False)  # the suite's own choice
    expected = {"tpu": "pallas_tpu", "gpu": "xla", "cpu": "xla"}[jax.default_backend()]
    assert resolve_impl("auto") == expected
    monkeypatch.setenv("JAXFILL_ATTENTION_IMPL", "pallas_gpu")
    assert resolve_impl("auto") == "pallas_gpu" and resolve_impl("xla") == "xla"
    monkeypatch.setenv("JAXFILL_ATTENTION_IMPL", "flash")
    with pytest.raises(ValueError, match="JAXFILL_ATTENTION_IMPL='flash' is not an attention impl"):
        resolve_impl("auto")
    for name in IMPLS:
        assert resolve_impl(name) == name
    with pytest.raises(ValueError, match="unknown attention impl"):
        resolve_impl("flash")


def test_work_items_cover_every_token_once():
    # Blocks of 4 tokens over sequences of 3, 0, 6, 1, 5 tokens (+ padding to 20 tokens).
    q_lens = [3, 0, 6, 1, 5]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens), [15]]), jnp.int32)
    blk, seq, n = work_items(cu, jnp.asarray([5], jnp.int32), num_blocks=5, block_q=4)
    n = int(n)
    pairs = list(zip(np.asarray(blk)[:n].tolist(), np.asarray(seq)[:n].tolist()))
    owner = np.repeat(np.arange(5), q_lens)
    real = {(t // 4, int(owner[t])) for t in range(15)}
    assert real <= set(pairs)
    # Extra items may only name the empty sequence 1 (inside block 0's range; no rows).
    assert set(pairs) - real <= {(0, 1)}
    assert len(pairs) == len(set(pairs)) <= 5 + 5
    # Items past n repeat the last real one (TPU grids rely on it).
    assert (np.asarray(blk)[n:] == blk[n - 1]).all() and (np.asarray(seq)[n:] == seq[n - 1]).all()


def _check_rows(out, ref, rows, tol=1e-5):
    out = np.asarray(out, np.float64)
    assert np.isfinite(out[rows]).all(), "skipped-range NaN leaked into a checked row"
    live = np.zeros(len(out), bool)
    live[rows] = True
    assert rel_err(out, ref, live) <= tol


@pytest.mark.parametrize("impl", sorted(BLOCKED))
def test_blocks_above_diagonal_are_skipped(impl):
    """K/V of keys >= 2B are NaN (yet inside kv_len). Rows < 2B only need keys < 2B; a
    kernel that computed-and-masked the blocks above their diagonal would turn them NaN
    (0 * NaN in P @ V)."""
    bq = bk = 16
    n = 4 * bq
    batch = make_batch([(n, n)], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8,
                       seed=1)
    batch.kv_pages[batch.page_indices[0, 2 * bk // 8:4 * bk // 8]] = np.nan
    ref, _ = oracle(*batch.args(), sm_scale=0.125)
    out = BLOCKED[impl](*map(jnp.asarray, batch.args()), sm_scale=0.125, block_q=bq,
                        block_kv=bk)
    _check_rows(out, ref, np.arange(2 * bq))


@pytest.mark.parametrize("impl", sorted(BLOCKED))
def test_blocks_before_window_are_skipped(impl):
    """Keys of block 0 are NaN; with window B, rows >= 2B never see block 0, and their
    query blocks must start the KV loop past it (first KV block != 0)."""
    bq = bk = 16
    n = 4 * bq
    batch = make_batch([(n - 8, n)], num_q_heads=2, num_kv_heads=1, head_dim=64,
                       page_size=8, seed=2)
    batch.kv_pages[batch.page_indices[0, :bk // 8]] = np.nan
    ref, _ = oracle(*batch.args(), sm_scale=0.125, sliding_window=bk)
    out = BLOCKED[impl](*map(jnp.asarray, batch.args()), sm_scale=0.125, sliding_window=bk,
                        block_q=bq, block_kv=bk)
    # Token t sits at position t + 8; rows of query blocks starting at 2B see keys > B.
    _check_rows(out, ref, np.arange(2 * bq, n - 8))


def test_tpu_kernel_has_no_races():
    """A mixed batch with blocks straddling sequences, several KV blocks per item (so the
    double buffer flips) and a decode row, under the TPU interpreter with race detection."""
    batch = make_batch([(1, 9), (7, 20), (0, 0), (13, 29), (1, 1)], num_q_heads=4,
                       num_kv_heads=2, head_dim=64, page_size=4, num_tokens=24, num_slots=6,
                       seed=5)
    out = ragged_paged_attention_tpu(*map(jnp.asarray, batch.args()), sm_scale=0.125,
                                     block_q=8, block_kv=8, interpret=interpret_params())
    out = np.asarray(jax.block_until_ready(out))
    assert not races_found(), "TPU interpreter detected a data race"
    ref, live = oracle(*batch.args(), sm_scale=0.125)
    assert rel_err(out, ref, live) <= 1e-5


def test_race_detector_is_live():
    """The detector fires on a kernel that reads a DMA target before waiting on it (so
    'no race' above is a real result, not a dead flag). jax 0.10/0.11 set the flag the
    test above reads; jax 0.12 raises at the racy access (which would fail that test too)."""

    def racy(x_hbm, o_ref, buf, sem):
        copy = pltpu.make_async_copy(x_hbm, buf, sem.at[0])
        copy.start()
        o_ref[...] = buf[...] * 2
        copy.wait()

    call = pl.pallas_call(
        racy, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA((1,))],
        interpret=interpret_params())
    try:
        jax.block_until_ready(call(jnp.ones((8, 128), jnp.float32)))
        fired = races_found()
    except Exception as e:  # noqa: BLE001 - jax >= 0.12: the interpreter raises instead
        fired = "RACE DETECTED" in str(e)
        if not fired:
            raise
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    assert fired


@pytest.mark.parametrize("impl", ["xla", "pallas_tpu", "pallas_gpu"])
def test_nan_query_padding_and_jit(impl):
    """Under an outer jit, NaN padding rows of q come out finite (zeros)."""
    batch = make_batch([(5, 12), (1, 3)], num_q_heads=4, num_kv_heads=2, head_dim=64,
                       page_size=4, num_tokens=16, num_slots=4, seed=9)
    fn = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.125, impl=impl))
    out = np.asarray(fn(*map(jnp.asarray, batch.args())))
    assert np.isfinite(out).all()
    assert (out[6:] == 0).all()
