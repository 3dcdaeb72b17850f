"""Attention under a mesh: heads over 'tensor', the page pool and its keys over 'sequence'.

`sharded_attention` runs an attention callback per device. With 'sequence' = N > 1 it is
context parallel, pass-Q form: each rank holds num_pages / N pages (logical page j of a
sequence on rank j mod N, models/sharding.py), so no rank can attend its query rows
alone. Instead every rank

1. all-gathers the layer's Q and new K/V rows over 'sequence' (the rows of a page may
   come from any rank's slice of the batch);
2. writes the rows whose pages it owns (`stripes.local_slots`; others write nothing);
3. attends every query row against its own pages: the kernel walks a local page table
   (`page_indices[:, r::N]`) and maps local keys to positions (`kv_stride`, `kv_offset`),
   returning each row's output and log-sum-exp;
4. merges: one all-max of the LSEs, then one reduce-scatter of the weighted outputs and
   weights [T, H, D + 1] f32 that leaves each rank the exact result for its own rows.

Every rank does 1/N of every sequence's attention (round-robin pages balance the causal
triangle to within a page), for prefill chunks, prefix-cache hits and decodes alike:
one code path. Per layer it moves Q and the new K/V in (all-gather) and the outputs out
(reduce-scatter), O(T) bytes, never the cached keys. Attention sinks (gpt-oss) enter once,
at the merge, not in each rank's partial softmax.

A step with nothing cached may instead take the pass-KV ring (models/parallel/ring_attention.py):
`sharded_attention(..., ring=RingSpec(...))` picks it per step with `lax.cond`.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxfill.models.parallel.ring_attention import RingSpec, no_cached_keys, ring_attention
from jaxfill.models.sharding import DATA, HEADS, SEQUENCE, context_mesh, free_axes, mesh_axis_size
from jaxfill.pallas_kernels.kv_quant import QuantizedPages
from jaxfill.pallas_kernels.ragged_paged_attention.stripes import local_page_table, local_slots


def sharded_attention(attend: Callable, q: jax.Array, k: jax.Array, v: jax.Array,
                      pages, meta,
                      head_args=None,  # a pytree of per-head arrays, heads first, split like q's heads
                      sinks: bool = False,  # head_args are attention sinks [Hq] f32: the merge adds them
                      ring: RingSpec | None = None,  # the pass-KV ring's settings; None: pass-Q only
                      replicated=None,  # a pytree every device gets whole; attend takes it as `replicated=`
                      ) -> tuple[jax.Array, jax.Array]:
    """Runs `attend(q, k, v, pages, meta, head_args, share) -> (result, pages)` per device.

    `attend` writes k/v into pages at meta.slot_mapping (one row per k/v row) and attends
    the q rows meta.cu_q_lens/kv_lens describe, passing `share` (a dict) on to the kernel.
    `share` is {} unless pages are split over 'sequence'; then it carries the rank's
    stripe and asks for the LSE, and `result` must be (out, lse). Heads are split over
    'tensor' (q, k, v, the pages' head axis, head_args). Without a mesh: attend as is.
    With `ring` and unquantized pages, a step with nothing cached takes the pass-KV ring
    instead (models/parallel/ring_attention.py; `lax.cond` on the metadata, the same on every rank).
    `replicated` (DeepSeek sparse attention's indexer queries, models/mixers/mla_indexer.py) is
    not split: not over 'tensor', and it has no form under 'sequence' (refused at config time).
    """
    mesh = context_mesh()
    axes = () if mesh is None else free_axes(mesh, *HEADS, SEQUENCE)
    if not axes:
        return attend(q, k, v, pages, meta, head_args, {}, **_whole(replicated))
    heads = tuple(a for a in HEADS if a in axes)
    tp = (heads[0] if len(heads) == 1 else heads) if heads else None
    sp = SEQUENCE if SEQUENCE in axes else None
    if tp and (q.shape[1] % mesh_axis_size(mesh, tp) or k.shape[1] % mesh_axis_size(mesh, tp)):
        raise ValueError(f"heads q={q.shape[1]} k={k.shape[1]} must split over tensor x expert "
                         f"= {mesh_axis_size(mesh, tp)}")
    if sp and replicated is not None:
        raise ValueError("replicated attention inputs (the sparse-attention indexer) have no mesh.sequence form")
    if sp and q.shape[0] % mesh_axis_size(mesh, sp):
        raise ValueError(f"{q.shape[0]} tokens must split over sequence={mesh_axis_size(mesh, sp)}; pad the batch")

    use_ring = ring is not None and sp is not None and not isinstance(pages, QuantizedPages)
    ring_now = no_cached_keys(meta) if use_ring else jnp.bool_(False)
    if use_ring and DATA in (getattr(mesh, "manual_axes", ()) or ()):
        # inside the data-parallel map every replica must take the same branch: XLA:CPU
        # deadlocked when one replica's ranks rang while another's gathered
        ring_now = jax.lax.pmin(ring_now.astype(jnp.int32), DATA) > 0

    def local(q, k, v, pages, meta, head_args, ring_now, replicated):
        if not sp:
            return attend(q, k, v, pages, meta, head_args, {}, **_whole(replicated))
        count = mesh_axis_size(mesh, sp)
        pass_q = lambda: context_attention(attend, q, k, v, pages, meta, head_args, sinks, sp, count)  # noqa: E731
        if not use_ring:
            return pass_q()
        pass_kv = lambda: ring_attention(q, k, v, pages, meta, ring, sp, count,  # noqa: E731
                                         head_args if sinks else None)
        return jax.lax.cond(ring_now, pass_kv, pass_q)

    tok = P(sp, tp, None)
    # per leaf: pages [N, ps, 2H, D] and, for a quantized layer, scales [N, ps, 2H]
    page_spec = jax.tree.map(lambda a: P(sp, None, tp, *([None] * (a.ndim - 3))), pages)
    head_spec = None if head_args is None else jax.tree.map(lambda _: P(tp), head_args)
    whole = None if replicated is None else jax.tree.map(lambda _: P(), replicated)
    return jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, page_spec, P(), head_spec, P(), whole),
                         out_specs=(tok, page_spec), axis_names=set(axes),
                         check_vma=False)(q, k, v, pages, meta, head_args, ring_now, replicated)


def _whole(replicated) -> dict:
    return {} if replicated is None else {"replicated": replicated}


def context_attention(attend: Callable,
                      q: jax.Array,  # [T/N, Hq', D] this rank's query rows
                      k: jax.Array,  # [T/N, Hkv', D]
                      v: jax.Array,  # [T/N, Hkv', D]
                      pages,  # [P/N, page_size, 2 Hkv', D] this rank's pages (or QuantizedPages)
                      meta,  # AttentionMetadata of the whole step (global page ids and slots)
                      head_args, sinks: bool, axis: str, count: int):
    """Steps 1-4 of the module doc, inside shard_map over `axis`: (out [T/N, Hq', D'], pages)."""
    rows = q.shape[0]
    rank = jax.lax.axis_index(axis)
    pool = jax.tree.leaves(pages)[0]
    per_rank, page_size = pool.shape[0], pool.shape[1]
    q, k, v = (jax.lax.all_gather(x, axis, axis=0, tiled=True) for x in (q, k, v))
    mine = type(meta)(cu_q_lens=meta.cu_q_lens, kv_lens=meta.kv_lens,
                      page_indices=local_page_table(meta.page_indices, count, rank, per_rank),
                      num_seqs=meta.num_seqs,
                      slot_mapping=local_slots(meta.slot_mapping, rank, per_rank, page_size),
                      logits_indices=meta.logits_indices)
    share = {"kv_stride": count, "kv_offset": rank, "return_lse": True}
    (out, lse), pages = attend(q, k, v, pages, mine, None if sinks else head_args, share)
    merged = merge_by_lse(out, lse, axis, rank * rows, rows, head_args if sinks else None)
    return merged.astype(q.dtype), pages


def merge_by_lse(out: jax.Array,  # [T, H, D] f32, this rank's partial output of every row
                 lse: jax.Array,  # [T, H] f32, its log-sum-exp (-inf: no key here)
                 axis: str, first: jax.Array, rows: int,
                 sinks: jax.Array | None = None,  # [H] f32 attention sinks, natural log
                 ) -> jax.Array:  # [rows, H, D] f32: rows [first, first + rows), merged
    """softmax over the union of the ranks' keys = sum_r e^(lse_r - m) out_r / sum_r e^(lse_r - m)."""
    top = jax.lax.pmax(lse, axis)
    top = jnp.where(jnp.isfinite(top), top, 0.0)  # rows no rank saw (padding) stay 0
    weight = jnp.exp(lse - top)  # [T, H]; 0 where this rank saw no key
    both = jnp.concatenate([out * weight[..., None], weight[..., None]], axis=-1)
    both = jax.lax.psum_scatter(both, axis, scatter_dimension=0, tiled=True)  # [rows, H, D + 1]
    num, den = both[..., :-1], both[..., -1]
    if sinks is not None:
        den = den + jnp.exp(sinks[None, :] - jax.lax.dynamic_slice_in_dim(top, first, rows))
    return num / jnp.where(den > 0, den, 1.0)[..., None]
