"""The model-side cache and batch metadata, both typed pytrees (never string-keyed dicts)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxfill.models.linear_state import cache_states, init_linear_state, joined_entry, split_entry
from jaxfill.models.moe import is_moe_layer
from jaxfill.models.sharding import (DATA, KV_CACHE_AXES, SEQUENCE, kv_cache_heads, kv_cache_sharding,
                                     linear_state_sharding)
from jaxfill.pallas_kernels import QUANT_DTYPES, QuantizedPages, init_kv_pages, init_quantized_pages
from jaxfill.pallas_kernels.kv_cache import page_storage_dtype


def kv_storage_dtype(kv_cache_dtype: str, model_dtype):
    """engine.kv_cache_dtype -> the pages' dtype ("auto": the model's compute dtype)."""
    if kv_cache_dtype == "auto":
        return jnp.dtype(model_dtype)
    if kv_cache_dtype not in QUANT_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto, {', '.join(QUANT_DTYPES)}; got {kv_cache_dtype!r}")
    return jnp.dtype(QUANT_DTYPES[kv_cache_dtype])


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str,
                       model_dtype, shared: bool = False) -> int:
    """Cache bytes one token costs over all layers: K and V values, plus one f32 scale per
    (K or V, head) when quantized. The planner and KVCache.nbytes agree on this."""
    dtype = kv_storage_dtype(kv_cache_dtype, model_dtype)
    per_head = (1 if shared else 2) * (head_dim * dtype.itemsize + (4 if kv_cache_dtype != "auto" else 0))
    return num_layers * num_kv_heads * per_head


def shares_kv(config) -> bool:
    """K-only pages (V is K): multi-head latent attention's one latent "head"."""
    return config.mla.enabled


def cache_entry(layer, stages: int):
    """One cache entry from `layer()` (one layer's fresh pages): as is, or for a stacked
    layout (stages > 1) broadcast to [stages, ...] (every row starts with the same fill)."""
    if stages == 1:
        return layer()
    return jax.tree.map(lambda a: jnp.broadcast_to(a[None], (stages,) + a.shape), layer())


def _cache_shardings(mesh, staged: bool, quantized: bool):
    values = kv_cache_sharding(mesh, staged=staged)
    if not quantized:
        return values
    return QuantizedPages(values, kv_cache_sharding(mesh, staged=staged, axes=KV_CACHE_AXES[:3]))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """One entry per layer: a page array [num_pages, page_size, 2 * Hkv, D], or, for an
    int8 / fp8 cache, a QuantizedPages (values of that shape + f32 scales
    [num_pages, page_size, 2 * Hkv]). Model code passes entries through untouched.

    A pipelined model's cache (`stages` = p > 1, models/parallel/pipeline.py) has L / p entries,
    each with a leading [p] axis: entry j, row s is layer s * (L / p) + j.

    `expert_tokens` (MoE models): per entry, the (token, expert) pairs each expert of that
    layer has been routed, counted on the device by every forward and carried here so no
    step waits on the host: [R * E] int32 (R data replicas, split like the page axis;
    [p, R * E] stacked), None for a dense layer, wrapping at 2**32 (engine/expert_load.py
    reads differences)."""

    pages: tuple
    stages: int = dataclasses.field(default=1, metadata=dict(static=True))
    expert_tokens: tuple | None = None

    @classmethod
    def create(cls, config, num_pages: int, page_size: int, dtype=None, fill_value: float = 0.0,
               kv_cache_dtype: str = "auto", stages: int = 1, mesh: jax.sharding.Mesh | None = None,
               state_slots: int = 1) -> "KVCache":
        """The one cache builder. With a mesh the cache is allocated in its shards (never
        whole on one device): `num_pages` is per data replica (as engine.num_pages), the
        global page axis holds data * num_pages, the heads are the model's KV heads
        repeated up to 'tensor' (models/sharding.py), and quantized scales are split like
        the pages' first three axes. With `stages` > 1 each entry is [stages, ...]. A
        linear-attention layer's entry is its LinearState (models/linear_state.py) with
        `state_slots` slots per data replica (split over 'data' like the pages, by heads over
        'tensor', replicated over 'expert'); a layer running attention beside
        its linear mixer (Falcon-H1) holds both, a PagesAndState; stacked like the pages.
        An MLP-only layer (config.no_mixer_layers) holds nothing: its entry is None."""
        if config.run_mtp and stages > 1:
            raise ValueError("the MTP layer's cache entry is not laid out in stages")
        if config.num_layers % stages:
            raise ValueError(f"{config.num_layers} layers do not split into {stages} equal stages")
        replicas = int(dict(mesh.shape).get(DATA, 1)) if mesh is not None else 1
        pool = num_pages * replicas
        shared = shares_kv(config)
        quantized = kv_cache_dtype != "auto"
        dtype = kv_storage_dtype(kv_cache_dtype, config.jnp_dtype) if quantized else page_storage_dtype(dtype or config.jnp_dtype)

        def layer(j: int):  # layer j's fresh pages, in its own shape (Gemma 4's full layers have theirs)
            heads, head_dim = config.attention_dims(j)
            if mesh is not None:
                heads = kv_cache_heads(config, mesh, heads)
            if quantized:
                return init_quantized_pages(pool, page_size, heads, head_dim, dtype, fill_value, shared)
            return init_kv_pages(pool, page_size, heads, head_dim, dtype, fill_value, shared)

        make = lambda j: cache_entry(lambda: layer(j), stages)  # noqa: E731
        counter = lambda: cache_entry(lambda: jnp.zeros((replicas * config.moe.num_experts,), jnp.int32), stages)  # noqa: E731
        if mesh is not None:
            make = jax.jit(make, static_argnums=0, out_shardings=_cache_shardings(mesh, stages > 1, quantized))
            counter = jax.jit(counter, out_shardings=kv_cache_sharding(mesh, staged=stages > 1, axes=("replicas",)))
        # the MTP proposer's layer (models/mtp.py) holds one more entry, after the target's
        entries = range(config.num_layers // stages + (1 if config.run_mtp else 0))
        if config.linear.layers:
            # one pool of slots per data replica, like the pages: replica r's slot i is row
            # r * state_slots + i, and inside the data-parallel forward each sees its own rows;
            # stacked ([stages, slots, ...]) like the pages, entry j row s being layer s * K + j
            state = lambda: cache_entry(lambda: init_linear_state(config, state_slots * replicas, fill_value),  # noqa: E731
                                        stages)
            if mesh is not None:
                state = jax.jit(state, out_shardings=linear_state_sharding(mesh, staged=stages > 1))
            return cls(tuple(joined_entry(make(j) if config.attends(j) else None,
                                          state() if j in config.linear.layers else None) for j in entries), stages)
        counters = None
        if config.moe.num_experts:  # stacked layouts hold one layer kind per entry (engine/config.check_stackable)
            counters = tuple(counter() if is_moe_layer(config, j) and j < config.num_layers else None
                             for j in entries)
        # an MLP-only layer holds nothing, nor does a layer reading an earlier one's pages (Gemma 4's E models)
        return cls(tuple(None if j in config.no_mixer_layers or config.kv_source(j) is not None else make(j)
                         for j in entries), stages, counters)

    def updated(self, pages, counts: tuple) -> "KVCache":
        """The cache after a forward: its new pages, and the forward's expert token counts
        (run_layers' per-entry tuple) added to the running ones. Entries after the forward's
        (the MTP layer's, models/mtp.py) are kept as they were."""
        pages = tuple(pages) + self.pages[len(pages):]
        if self.expert_tokens is None:
            return KVCache(pages, self.stages)
        return KVCache(pages, self.stages,
                       tuple(None if old is None else old + new for old, new in zip(self.expert_tokens, counts))
                       + self.expert_tokens[len(counts):])

    @property
    def _paged(self):  # the first layer's pages (a hybrid's linear layers hold states, MLP-only ones None)
        return next(p for p in (split_entry(e)[0] for e in self.pages) if p is not None)

    @property
    def _values_shape(self) -> tuple[int, ...]:  # one layer's [num_pages, page_size, 2H, D]
        shape = self._paged.shape
        return shape[1:] if self.stages > 1 else shape

    @property
    def num_pages(self) -> int:
        return self._values_shape[0]

    @property
    def page_size(self) -> int:
        return self._values_shape[1]

    @property
    def page_ranks(self) -> int:
        """The 'sequence' ranks the page axis is dealt over (context parallelism), else 1:
        kv_cache_sharding splits the pages over every 'sequence' axis a mesh has."""
        mesh = getattr(getattr(jax.tree.leaves(self._paged)[0], "sharding", None), "mesh", None)
        return int(dict(mesh.shape).get(SEQUENCE, 1)) if mesh is not None else 1

    @property
    def dtype(self):
        return self._paged.dtype

    def arrays(self) -> list[jax.Array]:
        """Every array the cache holds (values and scales)."""
        return jax.tree.leaves(self.pages)

    def nbytes(self) -> int:
        """Bytes of all layers, scales included (global shapes, all shards together)."""
        return sum(a.size * a.dtype.itemsize for a in self.arrays())

    def nbytes_on(self, device=None) -> int:
        """Bytes one device holds (default: this process's first), read from the arrays'
        shards: under mesh.sequence = N a 1/N share of the pool (tensor splits heads too)."""
        arrays = [a for a in self.arrays() if hasattr(a, "addressable_shards")]
        device = device or (arrays[0].addressable_shards[0].device if arrays else None)
        return sum(sh.data.nbytes for a in arrays for sh in a.addressable_shards if sh.device == device)

    def sizes(self) -> dict[str, int]:
        """The byte counts Engine.stats() reports. Read them here, once, where the cache is
        built: another thread must never touch the arrays, which each step donates."""
        return {"kv_cache_bytes": self.nbytes(), "kv_cache_bytes_per_device": self.nbytes_on(),
                "kv_bytes_per_token": self.bytes_per_token(), "state_bytes": self.state_bytes()}

    def state_bytes(self) -> int:
        """Bytes of the linear-attention layers' state slots (a hybrid's; 0 otherwise): fixed,
        whatever the number of pages."""
        states = cache_states(self.pages)
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(states))

    def bytes_per_token(self) -> int:
        """Page bytes per page slot: what one cached token costs (over every data replica's
        pool and every KV head the layout holds, repeated heads included)."""
        return (self.nbytes() - self.state_bytes()) // (self.num_pages * self.page_size)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where each flat token belongs. S = padded sequence slots, P = max pages per seq."""

    cu_q_lens: jax.Array  # [S+1] int32, prefix sums of new tokens per sequence
    kv_lens: jax.Array  # [S] int32, cached + new tokens per sequence
    page_indices: jax.Array  # [S, P] int32, pages of each sequence in order
    num_seqs: jax.Array  # [1] int32, live sequences (the rest are padding)
    slot_mapping: jax.Array  # [T] int32, page * page_size + offset; -1 for padding tokens
    logits_indices: jax.Array  # [S] int32, the row whose logits each sequence samples: its last new token
    # (any [R] rows may be asked for, e.g. every row for evaluation; then the last layer runs on all rows)
    state_slots: jax.Array | None = None  # [S] int32, each sequence's linear-layer state slot; None: its row
    lora_slots: jax.Array | None = None  # [T] int32, each row's LoRA slot (0 = none; models/lora.py); None: no LoRA
    # [T] int32: the last key position a row sees when past its own (Gemma 3's image rows see
    # their whole image), -1: causal; None: causal everywhere (models/vision/rows.py)
    key_limits: jax.Array | None = None


def sampled_rows_metadata(meta: AttentionMetadata) -> AttentionMetadata:
    """The same batch seen by one query row per sequence, its sampled row (the last new
    token, `logits_indices`), attending its whole context: what the last layer needs."""
    s = meta.kv_lens.shape[0]
    cu = jnp.minimum(jnp.arange(s + 1, dtype=jnp.int32), meta.num_seqs[0])
    limits = None if meta.key_limits is None else jnp.take(meta.key_limits, meta.logits_indices)
    return dataclasses.replace(meta, cu_q_lens=cu, logits_indices=jnp.arange(s, dtype=jnp.int32), key_limits=limits)


def dealt_pages(count: int, num_pages: int, ranks: int = 1) -> list[int]:
    """Page ids for logical pages 0..count-1 of one sequence in a fresh pool of `num_pages`
    dealt over `ranks` (mesh.sequence): page j on rank j mod ranks, whose ids start at
    rank * num_pages / ranks; rank 0 skips the null page. With ranks = 1: 1, 2, 3, ...
    (what the engine's block manager does for a pool nobody else uses)."""
    per = num_pages // ranks
    if -(-count // ranks) >= per:
        raise ValueError(f"{count} pages do not fit a pool of {num_pages} dealt over {ranks} ranks")
    return [(j % ranks) * per + 1 + j // ranks for j in range(count)]


def single_sequence_metadata(num_tokens: int, start: int, pages: list[int], page_size: int,
                             pad_to: int | None = None) -> AttentionMetadata:
    """Metadata for one sequence whose tokens [start, start + num_tokens) are new.

    A convenience for notebooks and tests; the engine builds batches in engine/batch.py.
    """
    import numpy as np

    if num_tokens < 1 or start < 0:
        raise ValueError(f"need num_tokens >= 1 and start >= 0, got num_tokens={num_tokens}, start={start}")
    need = -(-(start + num_tokens) // page_size)
    if len(pages) < need:
        raise ValueError(f"tokens [0, {start + num_tokens}) need {need} pages of {page_size} tokens; "
                         f"got {len(pages)} pages: pass more pages (any free ones, in order)")
    total = pad_to or num_tokens
    if total < num_tokens:
        raise ValueError(f"pad_to={pad_to} is less than num_tokens={num_tokens}")
    pos = np.arange(start, start + num_tokens)
    slots = np.full(total, -1, np.int32)
    page_arr = np.asarray(pages, np.int32)
    slots[:num_tokens] = page_arr[pos // page_size] * page_size + pos % page_size
    return AttentionMetadata(
        cu_q_lens=jnp.asarray([0, num_tokens], jnp.int32),
        kv_lens=jnp.asarray([start + num_tokens], jnp.int32),
        page_indices=jnp.asarray(page_arr[None, :], jnp.int32),
        num_seqs=jnp.asarray([1], jnp.int32),
        slot_mapping=jnp.asarray(slots),
        logits_indices=jnp.asarray([num_tokens - 1], jnp.int32),
    )
