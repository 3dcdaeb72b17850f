"""Does an attention impl lower and agree with `xla` on this machine, at the model's shapes?

`impl="auto"` picks a Pallas kernel on TPU that CI only ever ran under the TPU
interpreter; the engine's warm-up calls `check_impl` before trusting it (and serves with
`xla` if it fails: engine/runner.py). The batch is small but mixed, like an engine step:
a fresh prefill, a chunk continuing a cached prefix, decodes, padding tokens and padding
sequences, pages out of order, and every unused page slot NaN. With an int8 / fp8 cache
the pages are quantized first (unused slots: NaN scales), so the quantized path is what
gets checked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def _seq_lens(page_size: int) -> list[tuple[int, int]]:
    """(new tokens, kv_len) per sequence: decode past 3 pages, a fresh prefill, a chunk
    after a cached prefix, a first-token decode, a decode ending a page."""
    p = page_size
    return [(1, 3 * p + 2), (2 * p + 3, 2 * p + 3), (p + 1, 3 * p), (1, 1), (1, p)]


def _mixed_batch(num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype, seed: int):
    """(q [T, Hq, D], pages [N, page_size, 2*Hkv, D], kv_lens [S], page_indices [S, P],
    cu_q_lens [S+1], num_seqs [1]) as numpy; 2 padding sequences, 8+ padding tokens."""
    rng = np.random.default_rng(seed)
    q_lens, kv_lens = map(list, zip(*_seq_lens(page_size)))
    n = len(q_lens)
    s_pad = n + 2
    t_pad = -(-(sum(q_lens) + 8) // 8) * 8
    need = [-(-k // page_size) for k in kv_lens]
    max_pages = max(need) + 1
    num_pages = sum(need) + 3
    pages = np.full((num_pages, page_size, 2 * num_kv_heads, head_dim), np.nan, np.float32)
    order = rng.permutation(np.arange(1, num_pages))  # page 0: the null page of padding
    page_indices = np.zeros((s_pad, max_pages), np.int32)
    at = 0
    for i, (k, npg) in enumerate(zip(kv_lens, need)):
        own = order[at:at + npg]
        at += npg
        page_indices[i, :npg] = own
        kv = rng.standard_normal((npg * page_size, 2 * num_kv_heads, head_dim)).astype(np.float32)
        kv[k:] = np.nan
        pages[own] = kv.reshape(npg, page_size, 2 * num_kv_heads, head_dim)
    cu = np.zeros(s_pad + 1, np.int32)
    cu[1:n + 1] = np.cumsum(q_lens)
    cu[n + 1:] = cu[n]
    q = rng.standard_normal((t_pad, num_q_heads, head_dim)).astype(np.float32)
    kv_lens = np.asarray(kv_lens + [0] * (s_pad - n), np.int32)
    return (q.astype(dtype), pages.astype(dtype), kv_lens, page_indices, cu,
            np.asarray([n], np.int32))


def tolerance(dtype) -> float:
    """Relative (Frobenius) error allowed against xla: both accumulate in f32, and with
    16-bit operands block boundaries change where p is rounded."""
    return 1e-4 if jnp.dtype(dtype).itemsize >= 4 else 2e-2


def check_impl(impl: str, *, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
               dtype=jnp.float32, sliding_window: int | None = None, soft_cap: float | None = None,
               seed: int = 0, kv_cache_dtype: str = "auto", attention_chunk: int | None = None) -> str | None:
    """None when `impl` lowers, runs and matches `xla` on the live rows; else why not (one
    line). Never raises for a failing impl: the caller decides what to fall back to."""
    from jaxfill.pallas_kernels.ragged_paged_attention import ragged_paged_attention

    args = list(map(jnp.asarray, _mixed_batch(num_q_heads, num_kv_heads, head_dim, page_size, dtype, seed)))
    live = int(args[4][int(args[5][0])])
    scales = None
    if kv_cache_dtype != "auto":
        from jaxfill.pallas_kernels.kv_quant import QUANT_DTYPES, quantize

        unused = jnp.isnan(args[1]).any(axis=-1)  # [N, page_size, 2*Hkv]
        args[1], scales = quantize(jnp.nan_to_num(args[1]), QUANT_DTYPES[kv_cache_dtype])
        scales = jnp.where(unused, jnp.nan, scales)

    def run(name):
        fn = jax.jit(functools.partial(ragged_paged_attention, sm_scale=head_dim ** -0.5,
                                       sliding_window=sliding_window, attention_chunk=attention_chunk,
                                       soft_cap=soft_cap, impl=name))
        return np.asarray(fn(*args, kv_scales=scales), np.float32)[:live]

    want = run("xla")
    try:
        got = run(impl)
    except Exception as e:  # noqa: BLE001 - a lowering/compile/run error is the answer
        return f"{type(e).__name__}: {_first_line(e)}"
    if got.shape != want.shape:
        return f"output shape {got.shape}, xla gives {want.shape}"
    if not np.isfinite(got).all():
        return f"non-finite output in {int((~np.isfinite(got)).any(axis=(1, 2)).sum())} of {live} rows"
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    if not err <= tolerance(dtype):
        return f"relative error {err:.3g} against xla exceeds {tolerance(dtype):.0e}"
    return None


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else "")[:300]
