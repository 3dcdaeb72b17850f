"""DeepSeek sparse attention's selection and attention (models/mixers/mla_indexer.py) against
a float64 NumPy oracle on a mixed batch: a chunk over a cached prefix longer than top-k, a
decode row, a fresh prefill shorter than it, a padding slot and padding rows, over
NaN-filled unused pages, plain and int8. The models' HF parity: tests/test_moe_parity.py
(MOE_KWARGS deepseek_v32, glm_moe_dsa) and tests/test_dsa_parity.py."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxfill.models.kv_cache import AttentionMetadata
from jaxfill.models.mixers import mla_indexer
from jaxfill.models.mixers.mla_indexer import needs_selection, select, sparse_attention
from jaxfill.pallas_kernels.kv_quant import QuantizedPages, dequantize, quantize

PAGE, PAGES, LAT, ROPE, DI, H, HI, TOPK = 4, 24, 8, 4, 6, 2, 3, 6
CACHED, NEW = [5, 20, 0], [7, 1, 4]  # per live sequence; a 4th slot is padding
WIDTH = LAT + ROPE + DI


def batch(rng):
    kv_lens = np.asarray([c + n for c, n in zip(CACHED, NEW)] + [0], np.int32)
    table = np.zeros((4, 7), np.int32)
    free = iter(rng.permutation(np.arange(1, PAGES)))
    pages = np.full((PAGES, PAGE, 1, WIDTH), np.nan, np.float32)
    entries = []
    for s, n in enumerate(kv_lens[:3]):
        table[s, :-(-n // PAGE)] = [next(free) for _ in range(-(-n // PAGE))]
        e = rng.standard_normal((n, WIDTH)).astype(np.float32)
        for j in range(n):
            pages[table[s, j // PAGE], j % PAGE, 0] = e[j]
        entries.append(e)
    cu = np.concatenate([[0], np.cumsum(NEW), [sum(NEW)]]).astype(np.int32)
    t = sum(NEW) + 3  # three padding rows
    positions = np.zeros(t, np.int32)
    for s, n in enumerate(NEW):
        positions[cu[s]:cu[s + 1]] = CACHED[s] + np.arange(n)
    meta = AttentionMetadata(cu_q_lens=jnp.asarray(cu), kv_lens=jnp.asarray(kv_lens),
                             page_indices=jnp.asarray(table), num_seqs=jnp.asarray([3], np.int32),
                             slot_mapping=jnp.full((t,), -1, jnp.int32), logits_indices=jnp.asarray(cu[1:] - 1))
    return pages, entries, meta, positions


def oracle(entries, q, w, qa, positions, sm_scale):  # float64: [live rows, H, LAT]
    out, row = [], 0
    for e, n in zip(entries, NEW):
        e = e.astype(np.float64)
        for i in range(n):
            pos = positions[row]
            keys = e[:pos + 1, LAT + ROPE:]
            index = np.maximum(np.einsum("hd,ld->hl", q[row], keys) * DI ** -0.5, 0).T @ w[row]  # [pos + 1]
            chosen = np.argsort(-index, kind="stable")[:TOPK]
            scores = np.einsum("hd,kd->hk", qa[row], e[chosen, :LAT + ROPE]) * sm_scale
            p = np.exp(scores - scores.max(-1, keepdims=True))
            out.append(np.einsum("hk,kc->hc", p / p.sum(-1, keepdims=True), e[chosen, :LAT]))
            row += 1
    return np.stack(out)


@pytest.mark.parametrize("form", ["masked_dense", "gathered"])
@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "int8"])
def test_top_k_attention_equals_the_float64_oracle(quantized, form, monkeypatch):
    """Both forms of sparse_attention (this batch's span is short: the masked dense one
    unless its size limit is set to 0)."""
    if form == "gathered":
        monkeypatch.setattr(mla_indexer, "DENSE_SCORES_MAX", 0)
    rng = np.random.default_rng(7)
    pages, entries, meta, positions = batch(rng)
    if quantized:  # the oracle reads what the int8 pages store
        values, scales = quantize(jnp.asarray(np.nan_to_num(pages)), "int8")
        stored = np.asarray(dequantize(values, scales, jnp.float32))
        table = np.asarray(meta.page_indices)
        entries = [np.stack([stored[table[s, j // PAGE], j % PAGE, 0] for j in range(len(e))])
                   for s, e in enumerate(entries)]
        pages = QuantizedPages(values, scales)
    else:
        pages = jnp.asarray(pages)
    t = len(positions)
    q = rng.standard_normal((t, HI, DI)).astype(np.float32)
    w = rng.standard_normal((t, HI)).astype(np.float32)
    qa = rng.standard_normal((t, H, LAT + ROPE)).astype(np.float32)
    chosen, valid = select(pages, meta, jnp.asarray(q), jnp.asarray(w), jnp.asarray(positions), LAT + ROPE, TOPK)
    # a row sees min(TOPK, pos + 1) valid keys, all causal; padding rows none
    live = sum(NEW)
    assert np.asarray(valid).sum(1).tolist() == [min(TOPK, p + 1) for p in positions[:live]] + [0, 0, 0]
    got = np.asarray(sparse_attention(pages, meta, jnp.asarray(qa), chosen, valid, 0.3, LAT))
    assert np.isfinite(got).all() and not got[live:].any()
    np.testing.assert_allclose(got[:live], oracle(entries, q, w, qa, positions, 0.3), rtol=2e-5, atol=2e-5)


def test_selection_is_needed_only_past_top_k():
    _, _, meta, _ = batch(np.random.default_rng(0))
    assert bool(needs_selection(meta, TOPK))  # the 21-token sequence
    assert not bool(needs_selection(meta, 21))
