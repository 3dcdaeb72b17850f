"""Ragged paged attention: one API, one module per backend, `reference` as the oracle."""

from __future__ import annotations

import importlib
import os

import jax

from jaxfill.pallas_kernels.kv_cache import WORDS, page_values
from jaxfill.pallas_kernels.kv_quant import QuantizedPages, is_quantized

# impl name -> (module, function). Modules import lazily so a backend's toolchain is
# only needed when that backend is asked for.
IMPLS = {
    "reference": ("jaxfill.pallas_kernels.ragged_paged_attention.reference",
                  "ragged_paged_attention_reference"),
    "xla": ("jaxfill.pallas_kernels.ragged_paged_attention.xla", "ragged_paged_attention_xla"),
    "pallas_tpu": ("jaxfill.pallas_kernels.ragged_paged_attention.tpu", "ragged_paged_attention_tpu"),
    "pallas_gpu": ("jaxfill.pallas_kernels.ragged_paged_attention.gpu", "ragged_paged_attention_gpu"),
    # Hopper-only, never run on a GPU (lowered for CUDA and interpreted on CPU only):
    # explicit opt-in, never picked by "auto" until the GPU oracle tests pass.
    "mosaic_gpu": ("jaxfill.pallas_kernels.ragged_paged_attention.mosaic_gpu",
                   "ragged_paged_attention_mosaic_gpu"),
}


# What "auto" resolves to when set (an impl name): a deployment's override without editing
# its configs, and the test suite's way of serving the reference impl, whose step programs
# compile ~6x faster on XLA:CPU than the blocked xla loop (tests/conftest.py).
AUTO_IMPL_ENV = "JAXFILL_ATTENTION_IMPL"


def resolve_impl(impl: str) -> str:
    """Maps "auto" to $JAXFILL_ATTENTION_IMPL, else to the backend's best impl; validates
    explicit names."""
    if impl == "auto":
        chosen = os.environ.get(AUTO_IMPL_ENV)
        if chosen:
            if chosen not in IMPLS:
                raise ValueError(f"{AUTO_IMPL_ENV}={chosen!r} is not an attention impl; choose from "
                                 f"{', '.join(IMPLS)}")
            return chosen
        # TPU: the Mosaic kernel. GPU: XLA's blocked loop until benchmarks/gpu_kernels.sh
        # shows the Pallas GPU kernel ahead on real hardware. CPU: the XLA loop. Never
        # mosaic_gpu: it has never run on a GPU.
        return "pallas_tpu" if jax.default_backend() == "tpu" else "xla"
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; choose from auto, {', '.join(IMPLS)}")
    return impl


def validate(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, kv_scales=None, sinks=None,
             kv_shared: bool = False):
    """Static shape checks at trace time, so mistakes fail here, not deep inside XLA."""
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must be [Hq] = [{q.shape[1]}] (one logit per query head), "
                         f"got {sinks.shape}")
    quantized = is_quantized(kv_pages.dtype)
    if quantized != (kv_scales is not None):
        raise ValueError(f"kv_scales must be given exactly when kv_pages are int8/float8_e4m3fn: "
                         f"pages {kv_pages.dtype}, scales {None if kv_scales is None else kv_scales.shape}")
    if kv_scales is not None and kv_scales.shape != kv_pages.shape[:3]:
        raise ValueError(f"kv_scales must be [num_pages, page_size, 2*Hkv] = {kv_pages.shape[:3]}, "
                         f"got {kv_scales.shape}")
    if q.ndim != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {q.shape}")
    if kv_pages.ndim != 4 or (kv_pages.shape[2] % 2 and not kv_shared):
        raise ValueError(f"kv_pages must be [num_pages, page_size, 2*Hkv, D], got {kv_pages.shape}")
    num_kv_heads = kv_pages.shape[2] if kv_shared else kv_pages.shape[2] // 2
    if q.shape[2] != kv_pages.shape[3]:
        raise ValueError(f"head_dim mismatch: q {q.shape[2]} vs kv_pages {kv_pages.shape[3]}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of kv heads ({num_kv_heads})")
    s = kv_lens.shape[0]
    if kv_lens.ndim != 1 or page_indices.ndim != 2 or page_indices.shape[0] != s:
        raise ValueError(f"kv_lens [S] and page_indices [S, P] disagree: {kv_lens.shape}, {page_indices.shape}")
    if cu_q_lens.shape != (s + 1,):
        raise ValueError(f"cu_q_lens must be [S+1] = [{s + 1}], got {cu_q_lens.shape}")
    if num_seqs.shape != (1,):
        raise ValueError(f"num_seqs must be [1], got {num_seqs.shape}")


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    kv_pages,  # [num_pages, page_size, 2 * Hkv, D] array, or QuantizedPages
    kv_lens: jax.Array,  # [S] int32: cached + new tokens per sequence
    page_indices: jax.Array,  # [S, P] int32
    cu_q_lens: jax.Array,  # [S+1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    attention_chunk: int | None = None,  # keys of the row's own chunk of C positions only (window.py)
    soft_cap: float | None = None,
    impl: str = "auto",
    kv_scales: jax.Array | None = None,  # [num_pages, page_size, 2 * Hkv] f32 for int8/fp8 pages
    sinks: jax.Array | None = None,  # [Hq] f32, natural-log units
    kv_shared: bool = False,  # pages [.., Hkv, D] hold K only; V is K (multi-head latent attention)
    kv_stride: int = 1,  # context parallelism: these pages hold logical pages kv_offset + i * kv_stride
    kv_offset: jax.Array | None = None,  # int32 scalar: this rank (stripes.py)
    return_lse: bool = False,  # also each row's log-sum-exp [T, Hq] f32; out in f32
    key_limits: jax.Array | None = None,  # [T] int32: a row sees keys up to max(its position, this)
):  # [T, Hq, D] (and [T, Hq] with return_lse)
    """`kv_pages` may be a QuantizedPages (or int8/fp8 values with `kv_scales`): every
    impl dequantizes block by block inside the kernel (kv_quant.py).

    `sinks` (gpt-oss attention sinks): one learned logit per query head, an extra term
    exp(sinks[h]) in every row's softmax denominator with no value vector, so a head can
    put weight on "nothing": p_j = exp(s_j) / (sum_k exp(s_k) + exp(sinks[h])), s_j the
    scores after sm_scale and soft cap. Online softmax impls add it once, at the end.

    `kv_stride` / `kv_offset` / `return_lse` serve context parallelism (models/sharding.py):
    one rank's share of every sequence's keys, and what it takes to merge the ranks'
    partial outputs. Only `xla` and `reference` take them so far ("auto" picks xla).

    `key_limits` (Gemma 3's image rows, which see their whole image): `reference` and
    `xla` take them (xla's item path serves every row of such a step), so a step that
    passes them runs `xla` when `impl` names a Pallas kernel (the steps that hold image
    rows; no Pallas kernel takes this mask yet)."""
    if isinstance(kv_pages, QuantizedPages):
        if kv_scales is not None:
            raise ValueError("QuantizedPages carry their own scales: do not pass kv_scales too")
        kv_pages, kv_scales = kv_pages.values, kv_pages.scales
    validate(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, kv_scales, sinks, kv_shared)
    context = kv_stride > 1 or return_lse
    if key_limits is not None and context:
        raise ValueError("key_limits (image rows attended both ways) have no context-parallel form (mesh.sequence)")
    name = resolve_impl(impl)
    if (context and impl == "auto" or key_limits is not None) and name not in ("xla", "reference"):
        name = "xla"
    if context and name not in ("xla", "reference"):
        raise ValueError(f"attention impl {name!r} does not take a context-parallel share of the pages "
                         f"(mesh.sequence > 1) yet: use impl='xla' (or 'auto')")
    if kv_pages.dtype == WORDS and name not in ("xla", "reference"):
        kv_pages = page_values(kv_pages)  # the Pallas kernels read bf16 (on CPU: interpreted, tests only)
    module, fn = IMPLS[name]
    kernel = getattr(importlib.import_module(module), fn)
    extra = {"kv_shared": True} if kv_shared else {}  # impls without it refuse shared pages (TypeError)
    if context:
        extra.update(kv_stride=kv_stride, kv_offset=kv_offset, return_lse=return_lse)
    if key_limits is not None:
        extra["key_limits"] = key_limits
    return kernel(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                  sm_scale=sm_scale, sliding_window=sliding_window, attention_chunk=attention_chunk, soft_cap=soft_cap,
                  kv_scales=kv_scales, sinks=sinks, **extra)
