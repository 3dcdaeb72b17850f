"""Pipeline parallelism over the mesh's 'stage' axis.

Layout. A model of L layers on p stages holds K = L / p layer modules whose params have a
leading [p] axis (layer s*K + j sits at [s] of module j) split over 'stage', and its KV
cache entry j is likewise [p, pages, page_size, 2H, D]. So stage s holds exactly layers
[s*K, (s+1)*K) and their pages (`stack_layers`, `KVCache.create(stages=p)`).

Schedule. GPipe fill-drain inside one step, in one jitted program: the step's T flat
tokens are cut into m microbatches of T/m rows. At tick t (0 .. m+p-2) stage s runs its K
layers on microbatch t - s (in its p-1 fill and drain ticks it skips them, `lax.cond`) and
hands the result to stage s+1 with a collective permute. Each microbatch's attention metadata is
re-cut to its rows (queries clipped, each sequence's kv_len shortened by its rows in later
microbatches), and the earlier microbatches wrote their K/V into this stage's pages at
earlier ticks, so every query sees exactly the keys it sees unpipelined: the tokens equal
the single-device model's. Decode rows are flat tokens like any other, so a decode step
pipelines across its sequences the same way. Idle share per stage: (p-1)/(m+p-1).

Only the rows whose logits are sampled leave the last stage (one psum of [S, E]); the
embedding runs before the pipeline and the final norm and LM head after it, on params
split over 'stage' by vocab (models/sharding.py), so no device holds them whole either.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxfill.models.fp8_block as fp8_block
from jaxfill.models.linear_state import cache_states, split_entry
from jaxfill.models.mixers.context import MixerContext
from jaxfill.models.moe import MoE
from jaxfill.models.moe_beside_dense import ExpertsBesideDense
from jaxfill.models.sharding import STAGE, context_mesh, mesh_axis_size, var_axes


def stack_layers(layers: list, stages: int) -> list:
    """L layer modules -> K = L / stages modules with every param stacked [stages, ...]
    (module j holds layers j, K + j, 2K + j, ...); logical axes gain a leading 'stage'."""
    if len(layers) % stages:
        raise ValueError(f"{len(layers)} layers do not split into {stages} equal stages")
    k = len(layers) // stages
    out = []
    for j in range(k):
        graphdef = nnx.split(layers[j])[0]
        group = [nnx.split(layers[s * k + j])[1] for s in range(stages)]

        def stack(*vs):  # fp8 block scales keep their layout (models/fp8_block.py)
            carried = {k: v for k, v in vs[0].get_metadata().items() if k == fp8_block.META}
            return nnx.Param(jnp.stack([v[...] for v in vs]), out_sharding=("stage",) + var_axes(vs[0]),
                             eager_sharding=False, **carried)

        state = jax.tree.map(stack, *group, is_leaf=lambda x: isinstance(x, nnx.Variable))
        out.append(nnx.merge(graphdef, state))
    return out


def microbatch_count(num_tokens: int, wanted: int) -> int:
    """The largest count <= wanted that divides the step's tokens (buckets are powers of two)."""
    m = max(1, min(wanted, num_tokens))
    while num_tokens % m:
        m -= 1
    return m


def rows_metadata(meta, lo: jax.Array, n: int):
    """Metadata for query rows [lo, lo + n) of the flat batch: each sequence's queries
    clipped to them and its kv_len cut by its queries after them (so a row still sees
    exactly the keys up to itself); slot_mapping stays global."""
    cu = meta.cu_q_lens
    local_cu = jnp.clip(cu - lo, 0, n).astype(jnp.int32)
    cut = jnp.maximum(cu[1:] - jnp.maximum(cu[:-1], lo + n), 0)  # queries of sequence s after the rows
    kv_lens = (meta.kv_lens - cut).astype(jnp.int32)
    return type(meta)(cu_q_lens=local_cu, kv_lens=kv_lens, page_indices=meta.page_indices,
                      num_seqs=meta.num_seqs, slot_mapping=meta.slot_mapping,
                      logits_indices=meta.logits_indices)


def microbatch_metadata(meta,  # AttentionMetadata of the whole step
                        lo: jax.Array,  # [] i32, first row of the microbatch
                        n: int,  # rows per microbatch
                        valid: jax.Array,  # [] bool, False in fill/drain ticks
                        ):
    """rows_metadata, with the rows' own slots (all -1, writing nothing,
    when not valid) and no queries when not valid."""
    meta = rows_metadata(meta, lo, n)
    slots = jax.lax.dynamic_slice_in_dim(meta.slot_mapping, lo, n)
    return dataclasses.replace(meta, cu_q_lens=jnp.where(valid, meta.cu_q_lens, 0),
                               slot_mapping=jnp.where(valid, slots, -1).astype(jnp.int32))


def run_layers(layers, x, positions, pages, meta, impl, prune_last: bool = False, row=0, per_layer=None,
               rope_positions=None, deepstack=None):
    """The one layer loop of every layout: the unrolled model's L layers, and one stage's
    (or one scan step's) group of K, which is row `row` (traced there) of the stacked
    modules: module i of it is layer row * K + i. `prune_last`: the last layer runs on
    the sampled rows only (the execution plan's prunes_last_layer). `per_layer`: Gemma 4's
    per-layer inputs [T, L, P]; its KV-sharing layers (`kv_source`, unrolled only) attend
    over an earlier layer's new pages and hold none. Returns x, the new pages and each
    layer's expert token counts ([experts] int32; None for a dense layer). `rope_positions`
    [T, R/2]: Qwen3-VL's per-frequency positions; `deepstack` [L', T, E]: what layer l < L'
    adds to its output rows (image rows; zeros elsewhere), unrolled only."""
    new, counts = [], []
    for i, (layer, layer_pages) in enumerate(zip(layers, pages)):
        ctx = MixerContext(positions, meta, impl, layer=row * len(pages) + i,
                           sampled_only=prune_last and i == len(pages) - 1, per_layer_input=per_layer,
                           rope_positions=rope_positions)
        source = getattr(layer, "kv_source", None)
        with jax.named_scope(f"layer_{i}"):
            x, layer_pages, layer_counts = layer(x, layer_pages if source is None else new[source], ctx)
        if deepstack is not None and i < deepstack.shape[0]:
            x = x + ctx.sampled(deepstack[i]).astype(x.dtype)  # the pruned last layer: its sampled rows
        new.append(layer_pages if source is None else None)
        counts.append(layer_counts)
    return x, tuple(new), tuple(counts)


def pipeline_layers(layers,  # nnx.List of K layers, params [p, ...]
                    x: jax.Array,  # [T, E] embedded tokens
                    positions: jax.Array,  # [T] i32
                    pages: tuple,  # K entries [p, N, page_size, 2H, D] (or QuantizedPages)
                    meta,  # AttentionMetadata
                    impl: str,
                    microbatches: int,
                    ) -> tuple[jax.Array, tuple, tuple]:  # rows [S, E] at meta.logits_indices, pages,
    # per module the expert token counts of each stage's layer [p, experts] (None: dense)
    """The K-layer groups of all stages, pipelined over 'stage' when the context mesh has
    it, else run one stage after another (same numbers)."""
    mesh = context_mesh()
    p = jax.tree.leaves(pages)[0].shape[0]
    if mesh is None or mesh_axis_size(mesh, STAGE) != p:
        return _sequential(layers, x, positions, pages, meta, impl, p)
    graphdef, state = nnx.split(layers)
    t = x.shape[0]
    m = microbatch_count(t, microbatches)
    n = t // m

    def local(state, x, positions, pages, meta):  # one stage: params [1, ...], pages [1, ...]
        s = jax.lax.axis_index(STAGE)
        mine = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], state))
        pages = jax.tree.map(lambda a: a[0], pages)

        def tick(i, carry):
            h, out, pages, counts = carry  # h [n, E]: what the previous stage handed over
            mb = i - s
            valid = (mb >= 0) & (mb < m)
            lo = jnp.clip(mb, 0, m - 1) * n
            inp = jnp.where(s == 0, jax.lax.dynamic_slice_in_dim(x, lo, n), h)
            pos, mb_meta = jax.lax.dynamic_slice_in_dim(positions, lo, n), microbatch_metadata(meta, lo, n, valid)
            # fill/drain ticks skip the layers: a stage's devices share `valid`, so any
            # collective inside (tensor parallelism) is skipped by all its members alike
            y, pages, mb_counts = jax.lax.cond(
                valid, lambda: run_layers(mine, inp, pos, pages, mb_meta, impl, row=s),
                lambda: (inp, pages, jax.tree.map(jnp.zeros_like, counts)))
            counts = jax.tree.map(jnp.add, counts, mb_counts)
            done = valid & (s == p - 1)
            out = jax.lax.dynamic_update_slice_in_dim(
                out, jnp.where(done, y, jax.lax.dynamic_slice_in_dim(out, lo, n)), lo, 0)
            h = jax.lax.ppermute(y, STAGE, [(a, a + 1) for a in range(p - 1)])
            return h, out, pages, counts

        counts = zero_counts(mine)
        carry = (jnp.zeros((n,) + x.shape[1:], x.dtype), jnp.zeros_like(x), pages, counts)
        _, out, pages, counts = jax.lax.fori_loop(0, m + p - 1, tick, carry)
        rows = jax.lax.psum(jnp.take(out, meta.logits_indices, axis=0), STAGE)  # last stage's
        return rows, *jax.tree.map(lambda a: a[None], (pages, counts))

    return jax.shard_map(local, mesh=mesh, in_specs=(P(STAGE), P(), P(), P(STAGE), P()),
                         out_specs=(P(), P(STAGE), P(STAGE)), axis_names={STAGE},
                         check_vma=False)(state, x, positions, pages, meta)


def zero_counts(layers) -> tuple:
    """Zero expert token counts shaped as run_layers returns them for these layers."""
    return tuple(jnp.zeros((layer.mlp.config.moe.num_experts,), jnp.int32)
                 if isinstance(layer.mlp, (MoE, ExpertsBesideDense)) else None
                 for layer in layers)


def _sequential(layers, x, positions, pages, meta, impl, p):
    """Stage after stage on whatever devices hold them (no 'stage' axis in context), as one
    lax.scan over the stacked rows: the program holds one stage's layers whatever p is, so
    with p = L (engine.scan_layers) compile time stops growing with depth. The carry sees
    each entry [p, N, ...] as one pool [p * N, ...] (a free reshape) and row s addresses
    its own pages in it by ids shifted by s * N, so no row of the cache is ever copied. A
    hybrid's state entries [p, slots, ...] pool the same way, row s's slots shifted by
    s * slots."""
    graphdef, state = nnx.split(layers)
    paged = [e for e in (split_entry(e)[0] for e in pages) if e is not None]
    n, page_size = jax.tree.leaves(paged[0])[0].shape[1:3]
    states = cache_states(pages)
    slots = states[0].recurrent.shape[1] if states else 0
    own = meta.state_slots if meta.state_slots is not None else jnp.arange(meta.kv_lens.shape[0], dtype=jnp.int32)
    pool = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), tuple(pages))  # [p * N, page_size, ...]

    def body(carry, xs):
        x, pool = carry
        s, row = xs
        shifted = dataclasses.replace(
            meta, page_indices=meta.page_indices + s * n,
            slot_mapping=jnp.where(meta.slot_mapping >= 0, meta.slot_mapping + s * n * page_size, -1),
            state_slots=(own + s * slots) if states else meta.state_slots)
        x, pool, counts = run_layers(nnx.merge(graphdef, row), x, positions, pool, shifted, impl, row=s)
        return (x, pool), counts

    (x, pool), counts = jax.lax.scan(body, (x, pool), (jnp.arange(p), state))  # counts [p, experts]
    return (jnp.take(x, meta.logits_indices, axis=0),
            jax.tree.map(lambda a, old: a.reshape(old.shape), pool, tuple(pages)), counts)
