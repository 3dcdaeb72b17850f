"""Float64 NumPy oracle for ragged paged attention, and a builder of ragged test batches.

The oracle shares no code with any impl (not even `reference.py`): it walks sequences
and rows one by one in float64, reading K/V only at positions < kv_len, so garbage in
unused page slots cannot influence it.

Quantized pages (int8 / float8_e4m3fn with per token-head f32 `kv_scales`): the oracle
reads exactly what a kernel computes with, `stored * scale` rounded to f32 and then to
q's dtype, and does the rest in float64. `make_batch(kv_dtype=...)` quantizes its random
K/V in NumPy (absmax / QMAX scales, no project code), garbage in unused pages AND scales.

Attention sinks (gpt-oss, `sinks[Hq]` natural-log logits): exp(sinks[h]) joins every
row's softmax denominator and has no value vector. The exact path takes the max over the
scores and the sink; the CastOrder path adds exp(sink - m) after its online softmax, m the
running max of the scores only, as the kernels do.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class CastOrder:
    """Where an impl rounds to its operand dtype (bf16); everything else is f32 math.

    The oracle mirrors these roundings in float64 so that, with the impl's own cast order,
    what is left between the two is f32 accumulation noise, far below one bf16 ulp.
    """
    q_prescale: float | None = None  # q * this in f32, then rounded; None: q as given
    round_scores: bool = False  # QK^T scores rounded (a matmul without an f32 result type)
    round_p: bool = False  # probabilities rounded before the PV matmul
    round_out: bool = True  # output rounded to the input dtype
    # Online softmax: P is rounded against the running max of the KV blocks seen so far,
    # blocks of block_kv keys from position 0 (an int, or one per sequence); None: one block.
    block_kv: int | tuple[int, ...] | None = None


def round_to(x, dtype):
    """x rounded to dtype (via f32, as a kernel's f32 -> bf16 cast), back in float64."""
    return np.asarray(x, np.float32).astype(dtype).astype(np.float64)


def _softmax_v(sc,  # [Hkv, G, K] natural-log units, K visible keys
               v,  # [K, Hkv, D]
               first_key: int, block_kv, round_p, dtype,
               sink=None):  # [Hkv, G, 1] sink logits, or None
    """softmax(sc) @ v the way a blocked online softmax rounds P (see CastOrder)."""
    hkv, g, k = sc.shape
    acc = np.zeros((hkv, g, v.shape[-1]))
    m = np.full((hkv, g, 1), -np.inf)
    l = np.zeros((hkv, g, 1))
    bk = block_kv or k + first_key
    edges = range(first_key // bk * bk, first_key + k, bk)
    for e in edges:
        lo, hi = max(e - first_key, 0), min(e + bk - first_key, k)
        s = sc[..., lo:hi]
        m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
        alpha = np.exp(m - m_new)
        p = np.exp(s - m_new)
        l = alpha * l + p.sum(axis=-1, keepdims=True)
        p = round_to(p, dtype) if round_p else p
        acc = alpha * acc + np.einsum("hgk,khd->hgd", p, v[lo:hi])
        m = m_new
    if sink is not None:
        l = l + np.exp(sink - m)
    return acc / l


def dequantized(kv_pages, kv_scales, dtype):
    """Pages as a kernel sees them, in float64 (see the module docstring)."""
    if kv_scales is None:
        return np.asarray(kv_pages, np.float64)
    stored = np.asarray(kv_pages).astype(np.float64)
    return round_to(stored * np.asarray(kv_scales, np.float64)[..., None], dtype)


def oracle(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
           sliding_window=None, soft_cap=None, cast=None, kv_scales=None, sinks=None, attention_chunk=None,
           key_limits=None):
    """Returns (out[T, Hq, D] float64, live[T] bool). Rows not live are left at 0.

    key_limits [T] (Gemma 3's image rows): row t sees keys up to max(its position, key_limits[t]).

    cast=None: exact attention of the given inputs. A CastOrder: the same, rounded where
    an impl rounds (to q's dtype), so bf16 impls can be held to a tight tolerance.
    """
    dtype = np.asarray(q).dtype
    q = np.asarray(q, np.float64)
    pages = dequantized(kv_pages, kv_scales, dtype)
    kv_lens, page_indices = np.asarray(kv_lens), np.asarray(page_indices)
    cu, n = np.asarray(cu_q_lens), int(np.asarray(num_seqs)[0])
    t, hq, d = q.shape
    _, page_size, combined, _ = pages.shape
    hkv = combined // 2
    g = hq // hkv
    out = np.zeros((t, hq, d))
    live = np.zeros(t, bool)
    score_scale = sm_scale
    if cast is not None and cast.q_prescale is not None:
        q = round_to(np.float32(q) * np.float32(cast.q_prescale), dtype)
        score_scale = sm_scale / cast.q_prescale
    block_kv = cast.block_kv if cast is not None else None
    sink = None if sinks is None else np.asarray(sinks, np.float64).reshape(hkv, g, 1)
    for s in range(n):
        kv_len = int(kv_lens[s])
        q_len = int(cu[s + 1] - cu[s])
        npg = -(-kv_len // page_size)
        kv = pages[page_indices[s, :npg]].reshape(npg * page_size, combined, d)[:kv_len]
        k, v = kv[:, 0::2], kv[:, 1::2]  # [K, Hkv, D]
        bk = block_kv[s] if isinstance(block_kv, tuple) else block_kv
        for i in range(q_len):
            row = int(cu[s]) + i
            live[row] = True
            pos = kv_len - q_len + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            if attention_chunk is not None:  # Llama 4: the row's own chunk of positions
                lo = max(lo, pos - pos % attention_chunk)
            qr = q[row].reshape(hkv, g, d)
            end = pos + 1 if key_limits is None else max(pos, int(key_limits[row])) + 1
            sc = np.einsum("khd,hgd->hgk", k[lo:end], qr)
            if cast is not None and cast.round_scores:
                sc = round_to(sc, dtype)
            sc = sc * score_scale
            if soft_cap is not None:
                sc = soft_cap * np.tanh(sc / soft_cap)
            if cast is None:
                mx = sc.max(axis=-1, keepdims=True)
                if sink is not None:
                    mx = np.maximum(mx, sink)
                p = np.exp(sc - mx)
                denom = p.sum(axis=-1, keepdims=True)
                if sink is not None:
                    denom = denom + np.exp(sink - mx)
                o = np.einsum("hgk,khd->hgd", p / denom, v[lo:end])
            else:
                o = _softmax_v(sc, v[lo:end], lo, bk, cast.round_p, dtype, sink)
            out[row] = o.reshape(hq, d)
    if cast is not None and cast.round_out:
        out = round_to(out, dtype)
    return out, live


@dataclasses.dataclass
class Batch:
    q: np.ndarray  # [T, Hq, D]
    kv_pages: np.ndarray  # [num_pages, page_size, 2 * Hkv, D]
    kv_lens: np.ndarray  # [S] int32
    page_indices: np.ndarray  # [S, P] int32
    cu_q_lens: np.ndarray  # [S + 1] int32
    num_seqs: np.ndarray  # [1] int32
    kv_scales: np.ndarray | None = None  # [num_pages, page_size, 2 * Hkv] f32 (int8/fp8 pages)

    def args(self):
        return (self.q, self.kv_pages, self.kv_lens, self.page_indices, self.cu_q_lens,
                self.num_seqs)


QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


def quantize_np(x,  # [..., D] float
                kv_dtype: str):  # -> stored [..., D], scale [...] f32
    import ml_dtypes

    absmax = np.abs(x).max(axis=-1).astype(np.float32)
    scale = np.where(absmax > 0, absmax / np.float32(QMAX[kv_dtype]), 1).astype(np.float32)
    y = np.clip(x / scale[..., None], -QMAX[kv_dtype], QMAX[kv_dtype])
    if kv_dtype == "int8":
        return np.round(y).astype(np.int8), scale
    return y.astype(ml_dtypes.float8_e4m3fn), scale


def make_batch(seqs, *, num_q_heads, num_kv_heads, head_dim, page_size, dtype=np.float32,
               num_tokens=None, num_slots=None, max_pages=None, num_pages=None, seed=0,
               garbage=np.nan, kv_dtype=None):
    """seqs: list of (q_len, kv_len) with kv_len >= q_len >= 0.

    Pages are a random permutation; every page slot no sequence owns, every position at or
    past a sequence's kv_len, every padding token row of q and every padding sequence's
    metadata is garbage (NaN by default), so leaks show up as NaN.
    """
    rng = np.random.default_rng(seed)
    n = len(seqs)
    total = sum(ql for ql, _ in seqs)
    num_tokens = num_tokens or max(total, 1)
    num_slots = num_slots or max(n, 1)
    need = [-(-kl // page_size) for _, kl in seqs]
    max_pages = max_pages or max(need + [1])
    num_pages = num_pages or sum(need) + 3
    assert num_tokens >= total and num_slots >= n and max_pages >= max(need + [0])
    assert num_pages >= sum(need)
    combined = 2 * num_kv_heads
    pages = np.full((num_pages, page_size, combined, head_dim), garbage, np.float32)
    perm = rng.permutation(num_pages)
    page_indices = np.zeros((num_slots, max_pages), np.int32)
    # Padding slots of page_indices point at real-but-unowned (garbage) pages.
    page_indices[:] = perm[-1]
    used = 0
    for s, (ql, kl) in enumerate(seqs):
        assert 0 <= ql <= kl
        ids = perm[used:used + need[s]]
        used += need[s]
        page_indices[s, :need[s]] = ids
        kv = rng.standard_normal((kl, combined, head_dim)).astype(np.float32)
        flat = pages[ids].reshape(-1, combined, head_dim)
        flat[:kl] = kv
        pages[ids] = flat.reshape(need[s], page_size, combined, head_dim)
    q = np.full((num_tokens, num_q_heads, head_dim), garbage, np.float32)
    q[:total] = rng.standard_normal((total, num_q_heads, head_dim)).astype(np.float32)
    cu = np.zeros(num_slots + 1, np.int32)
    cu[1:n + 1] = np.cumsum([ql for ql, _ in seqs])
    cu[n + 1:] = total
    kv_lens = np.zeros(num_slots, np.int32)
    kv_lens[:n] = [kl for _, kl in seqs]
    kv_lens[n:] = 7  # padding sequences: nonsense lengths the kernel must ignore
    q = q.astype(dtype)
    scales = None
    if kv_dtype is None:
        pages = pages.astype(dtype)
    else:  # quantize what sequences own; garbage stays garbage (int8 has no NaN: random)
        owned = ~np.isnan(pages).all(axis=-1)  # [num_pages, page_size, 2 * Hkv]
        stored, scales = quantize_np(np.nan_to_num(pages), kv_dtype)
        if kv_dtype == "int8":
            junk = rng.integers(-128, 128, stored.shape).astype(np.int8)
        else:
            junk = np.full(stored.shape, np.nan, np.float32).astype(stored.dtype)
        pages = np.where(owned[..., None], stored, junk)
        scales = np.where(owned, scales, np.float32(garbage))
    return Batch(q, pages, kv_lens, page_indices, cu, np.asarray([n], np.int32), scales)


def rel_err(out, ref, live):
    """max |out - ref| / max |ref| over live rows."""
    out = np.asarray(out, np.float64)[live]
    ref = ref[live]
    if ref.size == 0:
        return 0.0
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))
