"""Chunked local attention (Llama 4's `attention_chunk_size`) in every attention impl.

A row at position p sees only keys of its own chunk [k C, (k + 1) C), k = p // C: the
first row of a chunk sees itself alone, whatever came before (no sliding window does
that). Each impl against the float64 oracle on ragged batches whose rows cross chunk
boundaries (fresh prompts, a chunk after a cached prefix, decodes at and past a boundary),
blocks before a row's chunk skipped (NaN there), a context-parallel share merged by LSE,
and the Pallas kernels lowered for their hardware with the chunk mask in.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from attention_oracle import make_batch, oracle, rel_err
from jaxfill.pallas_kernels import ragged_paged_attention
from jaxfill.pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu
from jaxfill.pallas_kernels.ragged_paged_attention.mosaic_gpu import ragged_paged_attention_mosaic_gpu
from jaxfill.pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu
from jaxfill.pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla

CHUNK = 16
# (q_len, kv_len): a fresh prompt over 3 chunks, a chunk after a cached prefix that starts
# mid-chunk, a decode on a chunk's first position, a decode deep in a chunk, a short prompt
SEQS = [(40, 40), (21, 45), (1, 33), (1, 62), (5, 5)]
IMPLS = {
    "reference": functools.partial(ragged_paged_attention, impl="reference"),
    "xla": functools.partial(ragged_paged_attention, impl="xla"),
    # one-page KV blocks: every block bound of item_bounds counts
    "xla_small": functools.partial(ragged_paged_attention_xla, block_q=8, block_kv=4, diag_splits=1),
    "pallas_tpu": functools.partial(ragged_paged_attention, impl="pallas_tpu"),
    "pallas_gpu": functools.partial(ragged_paged_attention, impl="pallas_gpu"),
}


def _batch(seed=0, **kw):
    return make_batch(SEQS, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=4,
                      num_tokens=72, num_slots=6, seed=seed, **kw)


@pytest.mark.parametrize("window", [None, 7], ids=["chunk", "chunk+window"])
@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_chunked_matches_the_oracle(impl, window):
    batch = _batch()
    kw = dict(sm_scale=32 ** -0.5, sliding_window=window, attention_chunk=CHUNK)
    ref, live = oracle(*batch.args(), **kw)
    out = np.asarray(IMPLS[impl](*map(jnp.asarray, batch.args()), **kw), np.float64)
    assert np.isfinite(out[live]).all()
    assert rel_err(out, ref, live) <= 1e-5
    # the mask binds: without it the rows past the first chunk differ
    full, _ = oracle(*batch.args(), sm_scale=kw["sm_scale"], sliding_window=window)
    assert rel_err(full, ref, live) > 1e-2


def test_mosaic_gpu_chunked_in_its_interpreter():
    batch = make_batch(SEQS, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.bfloat16,
                       num_tokens=72, num_slots=6, seed=3)
    kw = dict(sm_scale=64 ** -0.5, attention_chunk=CHUNK)
    out = ragged_paged_attention_mosaic_gpu(*map(jnp.asarray, batch.args()), interpret=True, **kw)
    ref, live = oracle(*batch.args(), **kw)
    assert rel_err(np.asarray(out.astype(jnp.float32)), ref, live) <= 8e-3


@pytest.mark.parametrize("impl", ["xla_small", "pallas_tpu", "pallas_gpu"])
def test_blocks_before_the_chunk_are_skipped(impl):
    """Keys of the first chunk are NaN; rows of later chunks never see them, so their
    items must start the KV loop past them (a kernel that masked them would turn NaN)."""
    batch = make_batch([(48, 48)], num_q_heads=2, num_kv_heads=1, head_dim=32, page_size=4, seed=2)
    batch.kv_pages[batch.page_indices[0, :CHUNK // 4]] = np.nan
    kw = dict(sm_scale=32 ** -0.5, attention_chunk=CHUNK)
    blocks = {} if impl == "xla_small" else dict(block_q=8, block_kv=8)
    fn = IMPLS["xla_small"] if impl == "xla_small" else {
        "pallas_tpu": ragged_paged_attention_tpu, "pallas_gpu": ragged_paged_attention_gpu}[impl]
    out = np.asarray(fn(*map(jnp.asarray, batch.args()), **kw, **blocks), np.float64)
    ref, _ = oracle(*batch.args(), **kw)
    rows = np.arange(CHUNK, 48)
    assert np.isfinite(out[rows]).all()
    live = np.zeros(len(out), bool)
    live[rows] = True
    assert rel_err(out, ref, live) <= 1e-5


@pytest.mark.parametrize("impl", ["xla_small", "reference"])
def test_context_shares_merge_to_the_oracle(impl):
    """kv_stride = 2: each simulated rank's share with its LSE, merged in float64."""
    from test_context_attention import deal, merge

    batch = _batch(seed=5)
    kw = dict(sm_scale=32 ** -0.5, attention_chunk=CHUNK)
    ref, live = oracle(*batch.args(), **kw)
    parts = []
    for r, (pool, table) in enumerate(deal(batch, 2)):
        out, lse = IMPLS[impl](jnp.asarray(batch.q), jnp.asarray(pool), jnp.asarray(batch.kv_lens),
                               jnp.asarray(table), jnp.asarray(batch.cu_q_lens), jnp.asarray(batch.num_seqs),
                               kv_stride=2, kv_offset=jnp.int32(r), return_lse=True, **kw)
        parts.append((np.asarray(out)[live], np.asarray(lse)[live]))
    assert rel_err(merge(parts), ref[live], np.ones(live.sum(), bool)) < 1e-5


def _shapes(t=256, s=8, hq=4, d=128, ps=16, dt=jnp.bfloat16):
    return (jax.ShapeDtypeStruct((t, hq, d), dt), jax.ShapeDtypeStruct((64, ps, 2, d), dt),
            jax.ShapeDtypeStruct((s,), jnp.int32), jax.ShapeDtypeStruct((s, 32), jnp.int32),
            jax.ShapeDtypeStruct((s + 1,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32))


def test_kernels_lower_with_the_chunk_mask():
    """Mosaic TPU and Mosaic GPU lowerings from this CPU host (as tests/test_kernel_lowering.py
    does per preset), Llama 4 Scout's shapes: head_dim 128, GQA 5 cut to 4, chunk 8192."""
    kw = dict(sm_scale=128 ** -0.5, attention_chunk=8192)
    tpu = export.export(jax.jit(functools.partial(ragged_paged_attention_tpu, interpret=False, **kw)),
                        platforms=["tpu"])(*_shapes())
    assert "tpu_custom_call" in tpu.mlir_module()
    mosaic = export.export(jax.jit(functools.partial(ragged_paged_attention_mosaic_gpu, **kw)),
                           platforms=["cuda"])(*_shapes())
    assert "mosaic_gpu_v2" in mosaic.mlir_module()


def test_triton_lowers_with_the_chunk_mask():
    from test_kernel_lowering import TRITON_CALL, _on_an_h200

    fn = functools.partial(ragged_paged_attention_gpu, sm_scale=128 ** -0.5, attention_chunk=8192, interpret=False)
    with _on_an_h200():
        exp = export.export(jax.jit(fn), platforms=["cuda"],
                            disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*_shapes())
    assert TRITON_CALL in exp.mlir_module()
