"""Multi-head latent attention's two forms (models/mixers/mla.py absorbed, models/mixers/mla_expanded.py
expanded) against a float64 NumPy oracle of the per-head attention they both compute, on a
mixed batch (a chunk over a cached prefix, a decode row, a fresh prefill, a padding slot)
over NaN-filled unused pages; and the per-step choice between them."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxfill.models.config import ModelConfig
from jaxfill.models.kv_cache import AttentionMetadata
from jaxfill.models.mixers.mla import LatentAttention
from jaxfill.models.mixers.mla_expanded import compact_page_table, prefers_expanded, touched_pages
from jaxfill.pallas_kernels.kv_quant import QuantizedPages, dequantize, quantize

PAGE, PAGES, LAT, ROPE, NOPE, H = 4, 24, 16, 8, 12, 4
CACHED, NEW = [5, 9, 0], [7, 1, 13]  # per live sequence; a 4th slot is padding


def config(vd: int, form: str) -> ModelConfig:
    return ModelConfig.of(architecture="DeepseekV3ForCausalLM", hidden_size=32, num_heads=H, num_kv_heads=1,
                       head_dim=LAT + ROPE, rotary_dim=ROPE, kv_lora_rank=LAT, qk_rope_head_dim=ROPE,
                       qk_nope_head_dim=NOPE, v_head_dim=vd, mla_form=form)


def batch(rng):
    kv_lens = np.asarray([c + n for c, n in zip(CACHED, NEW)] + [0], np.int32)
    table = np.zeros((4, 6), np.int32)
    free = iter(rng.permutation(np.arange(1, PAGES)))
    for s, n in enumerate(kv_lens[:3]):
        table[s, :-(-n // PAGE)] = [next(free) for _ in range(-(-n // PAGE))]
    pages = np.full((PAGES, PAGE, 1, LAT + ROPE), np.nan, np.float32)
    entries = []  # per sequence [L, lat + rope]
    for s, n in enumerate(kv_lens[:3]):
        e = rng.standard_normal((n, LAT + ROPE)).astype(np.float32)
        for j in range(n):
            pages[table[s, j // PAGE], j % PAGE, 0] = e[j]
        entries.append(e)
    cu = np.concatenate([[0], np.cumsum(NEW), [sum(NEW)]]).astype(np.int32)
    t = sum(NEW) + 3  # three padding rows
    meta = AttentionMetadata(cu_q_lens=jnp.asarray(cu), kv_lens=jnp.asarray(kv_lens),
                             page_indices=jnp.asarray(table), num_seqs=jnp.asarray([3], np.int32),
                             slot_mapping=jnp.full((t,), -1, jnp.int32),
                             logits_indices=jnp.asarray(cu[1:] - 1))
    q = rng.standard_normal((t, H, NOPE + ROPE)).astype(np.float32)
    return q, pages, entries, meta


def oracle(q, entries, w_uk, w_uv, sm_scale):  # float64, per head and sequence: [live rows, H, vd]
    out, row = [], 0
    for e, n in zip(entries, NEW):
        e = e.astype(np.float64)
        c, pe = e[:, :LAT], e[:, LAT:]
        k = np.concatenate([np.einsum("kc,hcn->khn", c, w_uk), np.broadcast_to(pe[:, None], (len(e), H, ROPE))], -1)
        v = np.einsum("kc,hcv->khv", c, w_uv)
        qs = q[row:row + n].astype(np.float64)
        pos = len(e) - n + np.arange(n)
        scores = np.einsum("thd,khd->htk", qs, k) * sm_scale
        scores = np.where(np.arange(len(e))[None, None] <= pos[None, :, None], scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out.append(np.einsum("htk,khv->thv", p / p.sum(-1, keepdims=True), v))
        row += n
    return np.concatenate(out)


@pytest.mark.parametrize("vd", [10, 24], ids=["v_narrower", "v_wider"])
@pytest.mark.parametrize("form", ["absorbed", "expanded", "auto"])
@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_each_form_equals_the_float64_oracle(form, impl, vd):
    rng = np.random.default_rng(3)
    q, pages, entries, meta = batch(rng)
    w_uk = rng.standard_normal((H, LAT, NOPE)).astype(np.float32) / 4
    w_uv = rng.standard_normal((H, LAT, vd)).astype(np.float32) / 4
    attn = LatentAttention(config(vd, form), nnx.Rngs(0))
    got = attn._attend(jnp.asarray(q), jnp.asarray(pages), meta, jnp.asarray(w_uk), jnp.asarray(w_uv), impl)
    want = oracle(q, entries, w_uk, w_uv, attn.sm_scale)
    live = np.asarray(got)[:sum(NEW)]
    assert np.isfinite(live).all()
    np.testing.assert_allclose(live, want, rtol=2e-5, atol=2e-5)


def test_int8_latent_pages_expand_to_what_they_store():
    """The expanded form dequantizes the latent exactly as the absorbed kernels do."""
    rng = np.random.default_rng(4)
    q, pages, entries, meta = batch(rng)
    values, scales = quantize(jnp.asarray(np.nan_to_num(pages)), "int8")
    stored = np.asarray(dequantize(values, scales, jnp.float32))
    quantized = QuantizedPages(values, scales)
    table = np.asarray(meta.page_indices)
    entries = [np.stack([stored[table[s, j // PAGE], j % PAGE, 0] for j in range(len(e))])
               for s, e in enumerate(entries)]
    w_uk = rng.standard_normal((H, LAT, NOPE)).astype(np.float32) / 4
    w_uv = rng.standard_normal((H, LAT, 10)).astype(np.float32) / 4
    want = oracle(q, entries, w_uk, w_uv, (NOPE + ROPE) ** -0.5)
    for form in ("absorbed", "expanded"):
        attn = LatentAttention(config(10, form), nnx.Rngs(0))
        got = attn._attend(jnp.asarray(q), quantized, meta, jnp.asarray(w_uk), jnp.asarray(w_uv), "xla")
        np.testing.assert_allclose(np.asarray(got)[:sum(NEW)], want, rtol=2e-5, atol=2e-5, err_msg=form)


def test_compact_page_table_keeps_each_sequences_pages_in_order():
    rng = np.random.default_rng(5)
    _, _, _, meta = batch(rng)
    per_seq = touched_pages(meta.kv_lens, meta.num_seqs, PAGE)
    assert np.asarray(per_seq).tolist() == [3, 3, 4, 0]
    src, table = compact_page_table(meta.page_indices, per_seq, cap=10)
    src, table, pages = np.asarray(src), np.asarray(table), np.asarray(meta.page_indices)
    for s, n in enumerate([3, 3, 4]):
        assert src[table[s, :n]].tolist() == pages[s, :n].tolist()


def v3_meta(q_lens, kv_lens, page_size=64, pages_per_seq=1024):
    s = len(q_lens)
    return AttentionMetadata(cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
                             kv_lens=jnp.asarray(kv_lens, jnp.int32),
                             page_indices=jnp.zeros((s, pages_per_seq), jnp.int32),
                             num_seqs=jnp.asarray([s], jnp.int32), slot_mapping=jnp.zeros((1,), jnp.int32),
                             logits_indices=jnp.zeros((s,), jnp.int32))


V3 = dict(lat=512, rope=64, nope=128, vd=128)


def test_decode_stays_absorbed_and_long_chunks_expand():
    decide = lambda meta, cap=1 << 20: bool(prefers_expanded(meta, 64, cap, **V3))
    assert not decide(v3_meta([1] * 8, [4096] * 8))  # decode: one query per key
    assert decide(v3_meta([2048], [2048]))  # a fresh prefill: its keys are its queries
    assert not decide(v3_meta([2048], [2048]), cap=16)  # more pages than the workspace
    # over a 4096-token prefix the multiply-add counts cross between 128 and 256 tokens
    assert not decide(v3_meta([128], [4096 + 128]))
    assert decide(v3_meta([256], [4096 + 256]))
    # decode rows' contexts count against expanding the batch they ride in
    assert not decide(v3_meta([256] + [1] * 16, [4096 + 256] + [32768] * 16))
