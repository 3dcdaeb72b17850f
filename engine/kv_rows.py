"""A request's KV as token-major rows, read out of and written into the paged cache.

Why tokens, not pages: the reader may differ from the writer in page size, page ids and
tensor parallelism (two engines of disaggregated prefill, engine/disagg/), so the rows are
token-major and mesh-free:

    values [L, T, 2 * Hkv, D]   (cache dtype; K of head h at 2h, V at 2h + 1, as in the pages)
    scales [L, T, 2 * Hkv]      f32, only for an int8 / fp8 cache

T is the prompt's token count rounded up to a power-of-two number of the sender's
pages (few distinct shapes, so few compiles); rows past the real count are junk and
the receiver drops them. Hkv is the model's KV heads: when the sender's cache repeats
each head r times (Hkv < tensor, models/sharding.py) only every r-th head is sent, and
the receiver repeats them to its own r. The sender gathers onto one device before
offering (`jax.device_put`), so the receiver pulls plain single-device arrays and its
own jitted scatter reshards them into its cache: tensor=2 -> tensor=1 and back work
the same way, and so do the stacked layouts (mesh.stage, engine.scan_layers): rows
travel in layer order whatever either side's layout. The host KV tier keeps its blocks
in the same form (engine/kv_tier/page_offload.py), and a hybrid's recurrent state moves
by `export_state` / `import_state`.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from jaxfill.models.linear_state import LinearState, cache_states, joined_entry, split_entry
from jaxfill.pallas_kernels import QuantizedPages


@dataclasses.dataclass(frozen=True)
class Layout:
    """What both sides must agree on to read each other's rows (checked on import)."""

    num_layers: int
    num_kv_heads: int  # the model's, not the cache's repeated count
    head_dim: int
    dtype: str  # the values' dtype (the cache dtype: f32 / bf16 / int8 / float8_e4m3fn)
    quantized: bool
    # a hybrid's state per sequence: recurrent [Lin, Hv, Dk, Dv] and conv [Lin, C, K-1] shapes; () otherwise
    state: tuple = ()

    @classmethod
    def of(cls, config, cache) -> "Layout":  # either layout: both send [L, T, ...] rows
        leaf = paged_entries(cache)[0]
        values = leaf.values if isinstance(leaf, QuantizedPages) else leaf
        m = config.model
        states, skip = cache_states(cache.pages), 1 + (cache.stages > 1)  # stacked: [groups, slots, ...]
        layers = len(states) * (cache.stages if cache.stages > 1 else 1)
        state = tuple((layers,) + tuple(a.shape[skip:]) for a in (states[0].recurrent, states[0].conv)) \
            if states else ()
        return cls(m.kv_layers, m.num_kv_heads, m.head_dim, str(values.dtype), isinstance(leaf, QuantizedPages),
                   state)

    def to_json(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))  # tuples as lists: as the other side reads it


def paged_entries(cache) -> tuple:
    """The pages of the entries that hold some (a hybrid's linear layers hold a state instead,
    its MLP-only layers nothing; a parallel layer's PagesAndState gives its pages)."""
    return tuple(p for p in (split_entry(e)[0] for e in cache.pages) if p is not None)


def with_paged(cache, paged: tuple):
    """The cache with its paged entries replaced, in order."""
    it = iter(paged)
    entries = (split_entry(e) for e in cache.pages)
    return dataclasses.replace(cache, pages=tuple(joined_entry(None if p is None else next(it), s)
                                                  for p, s in entries))


def padded_tokens(num_tokens: int, page_size: int) -> int:
    """Rows sent for num_tokens: a power-of-two count of the sender's pages."""
    pages = max(1, -(-num_tokens // page_size))
    return (1 << (pages - 1).bit_length()) * page_size


def _repeat_of(leaf_values, num_kv_heads: int) -> int:
    return leaf_values.shape[2] // (2 * num_kv_heads)


def _entries(pages: tuple, stages: int) -> list:
    """The cache's entries, each with a leading stage axis ([p, N, P, ...]; p = 1 for the
    per-layer layout): layer s * K + j is row s of entry j (models/parallel/pipeline.py). Inside a
    jit, so the added axis is a free reshape."""
    if stages > 1:
        return list(pages)
    return [jax.tree.map(lambda a: a[None], leaf) for leaf in pages]


def _values_scales(entry):
    return (entry.values, entry.scales) if isinstance(entry, QuantizedPages) else (entry, None)


@functools.partial(jax.jit, static_argnames=("num_kv_heads", "stages", "replicate"))
def gather_tokens(pages: tuple,  # KVCache.pages: per layer [N, P, 2*Hc, D] or stacked [p, N, ...]
                  page_ids: jax.Array,  # [T // P] int32, the request's pages (padded with 0)
                  num_kv_heads: int,
                  stages: int = 1,
                  replicate: bool = False):  # True: a whole copy on every device (inside jax.set_mesh)
    """-> values [L, T, 2*Hkv, D], scales [L, T, 2*Hkv] or None: the request's rows."""
    def rows(a):  # [p, N, P, 2*Hc, ...] -> [p, T, 2*Hkv, ...]
        a = a[:, page_ids]
        a = a.reshape((a.shape[0], a.shape[1] * a.shape[2]) + a.shape[3:])
        r = a.shape[2] // (2 * num_kv_heads)
        if r > 1:  # keep one copy of each repeated head
            a = a.reshape(a.shape[:2] + (num_kv_heads, r, 2) + a.shape[3:])[:, :, :, 0]
            a = a.reshape(a.shape[:2] + (2 * num_kv_heads,) + a.shape[4:])
        return a

    def layers(parts):  # K x [p, T, ...] -> [p * K, T, ...] in layer order
        x = jnp.stack(parts, axis=1)
        return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])

    def whole(a):  # a multi-process engine: each process then reads its own copy
        return jax.lax.with_sharding_constraint(a, jax.sharding.PartitionSpec()) if replicate else a

    entries = _entries(pages, stages)
    values = whole(layers([rows(_values_scales(e)[0]) for e in entries]))
    if not isinstance(entries[0], QuantizedPages):
        return values, None
    return values, whole(layers([rows(e.scales) for e in entries]))


@functools.partial(jax.jit, donate_argnums=(0,), static_argnames=("stages",))
def scatter_tokens(pages: tuple,  # KVCache.pages (donated): per layer [N, P, 2*Hc, D] or [p, N, ...]
                   values: jax.Array,  # [L, T, 2*Hkv, D]
                   scales: jax.Array | None,  # [L, T, 2*Hkv] or None
                   slots: jax.Array,  # [T] int32, page * P + offset; -1 = drop the row
                   stages: int = 1):
    """Writes the rows into this engine's pages (its page size, ids, head repeat, layout)."""
    def put(a, rows):  # a [p, N, P, 2*Hc, ...], rows [p, T, 2*Hkv, ...]
        p, n, size = a.shape[:3]
        hkv2 = rows.shape[2]
        r = a.shape[3] // hkv2
        if r > 1:  # repeat each head r times in a row, K/V pairs kept together
            rows = rows.reshape(rows.shape[:2] + (hkv2 // 2, 1, 2) + rows.shape[3:])
            rows = jnp.broadcast_to(rows, rows.shape[:3] + (r,) + rows.shape[4:])
            rows = rows.reshape(rows.shape[:2] + (a.shape[3],) + rows.shape[5:])
        t = slots.shape[0]
        flat = a.reshape((p * n * size,) + a.shape[3:])
        row = jnp.arange(p)[:, None]
        idx = jnp.where(slots >= 0, row * n * size + slots, p * n * size + row * t + jnp.arange(t))  # [p, T]
        flat = flat.at[idx.reshape(-1)].set(rows.reshape((p * t,) + rows.shape[2:]).astype(a.dtype),
                                            mode="drop", unique_indices=True)
        return flat.reshape(a.shape)

    entries = _entries(pages, stages)
    k = len(entries)
    out = []
    for j, entry in enumerate(entries):
        p = _values_scales(entry)[0].shape[0]
        mine = lambda x: x.reshape((p, k) + x.shape[1:])[:, j]  # noqa: E731  layers s*K + j
        if isinstance(entry, QuantizedPages):
            out.append(QuantizedPages(put(entry.values, mine(values)), put(entry.scales, mine(scales))))
        else:
            out.append(put(entry, mine(values)))
    return tuple(out) if stages > 1 else tuple(jax.tree.map(lambda a: a[0], e) for e in out)


def slots_for(pages: list[int], num_tokens: int, total: int, page_size: int) -> np.ndarray:
    """[total] int32: row t < num_tokens goes to pages[t // P] * P + t % P, the rest -1."""
    slots = np.full(total, -1, np.int32)
    t = np.arange(num_tokens)
    slots[:num_tokens] = np.asarray(pages, np.int32)[t // page_size] * page_size + t % page_size
    return slots


def export_rows(cache, page_ids: list[int], num_tokens: int, page_size: int, num_kv_heads: int,
                replicate: bool = False):
    """The request's first num_tokens rows as single-device arrays: (values, scales or None).
    replicate (a multi-process engine, every process calling it inside the mesh): the
    gather leaves a whole copy on every device, and each process returns its own."""
    total = padded_tokens(num_tokens, page_size)
    ids = np.zeros(total // page_size, np.int32)  # null page for the padding rows
    ids[:len(page_ids)] = page_ids[:len(ids)]
    values, scales = gather_tokens(paged_entries(cache), jnp.asarray(ids), num_kv_heads=num_kv_heads,
                                   stages=cache.stages, replicate=replicate)
    dev = jax.local_devices()[0]
    local = (lambda a: a.addressable_data(0)) if replicate else (lambda a: a)  # noqa: E731
    values = jax.device_put(local(values), dev)
    scales = None if scales is None else jax.device_put(local(scales), dev)
    return values, scales


def import_rows(cache, values, scales, pages: list[int], num_tokens: int, page_size: int):
    """A new cache with the rows written into `pages` (the old one is donated). The pulled
    rows sit on one device; a cache split over several (mesh.tensor > 1) gets them
    replicated onto its devices first, since jit refuses arguments committed elsewhere
    (a multi-process engine's rows come already replicated: engine/disagg/runner_side.py)."""
    slots = slots_for(pages, num_tokens, values.shape[1], page_size)
    values, scales = _onto(cache, values), None if scales is None else _onto(cache, scales)
    pages = scatter_tokens(paged_entries(cache), values, scales, jnp.asarray(slots), stages=cache.stages)
    return with_paged(cache, pages)


def _onto(cache, a: jax.Array) -> jax.Array:
    """A pulled array (on one device, or a host tier's numpy snapshot) replicated onto a cache
    split over several (mesh.tensor or mesh.data > 1): jit refuses arguments committed elsewhere."""
    sharding = jax.tree.leaves(cache.pages)[0].sharding
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return a
    whole = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    if not isinstance(a, jax.Array) or not a.sharding.is_equivalent_to(whole, a.ndim):
        return jax.device_put(a, whole)
    return a


@functools.partial(jax.jit, static_argnames=("stages",))
def _gather_state(pages: tuple, slot: jax.Array, stages: int = 1):  # slot: [] int32
    """-> recurrent [Lin, ...], conv [Lin, ...] in layer order whatever the layout: a stacked
    entry j's row s is layer s * K + j, so the rows interleave group-major."""
    states = cache_states(pages)
    if stages == 1:
        return jnp.stack([e.recurrent[slot] for e in states]), jnp.stack([e.conv[slot] for e in states])

    def layers(parts):  # Lin/p x [p, ...] -> [p * Lin/p, ...]
        x = jnp.stack(parts, axis=1)
        return x.reshape((-1,) + x.shape[2:])
    return layers([e.recurrent[:, slot] for e in states]), layers([e.conv[:, slot] for e in states])


@functools.partial(jax.jit, donate_argnums=(0,), static_argnames=("stages",))
def _scatter_state(pages: tuple,  # KVCache.pages (donated)
                   recurrent: jax.Array,  # [Lin, Hv, Dk, Dv] f32
                   conv: jax.Array,  # [Lin, C, K-1]
                   slot: jax.Array,  # [] int32
                   stages: int = 1):
    if stages > 1:  # layer order -> [Lin/p, p, ...]: entry i's rows (the inverse of _gather_state)
        recurrent, conv = (a.reshape((stages, -1) + a.shape[1:]).swapaxes(0, 1) for a in (recurrent, conv))
    at = (lambda a: a.at[:, slot]) if stages > 1 else (lambda a: a.at[slot])  # noqa: E731
    out, i = [], 0
    for e in pages:
        paged, s = split_entry(e)
        if s is not None:  # a linear layer's state, or a parallel layer's beside its pages
            s = LinearState(at(s.recurrent).set(recurrent[i]), at(s.conv).set(conv[i].astype(s.conv.dtype)))
            e, i = joined_entry(paged, s), i + 1
        out.append(e)
    return tuple(out)


def export_state(cache, slot: int) -> list:
    """A hybrid's state in `slot`, as one-device arrays [recurrent [Lin, Hv, Dk, Dv], conv
    [Lin, C, K-1]]: new buffers, so the slot may be reused once this is dispatched."""
    dev = jax.local_devices()[0]
    return [jax.device_put(a, dev) for a in _gather_state(cache.pages, jnp.int32(slot), stages=cache.stages)]


def import_state(cache, arrays: list, slot: int):
    """A new cache with the pulled state written into `slot` (the old one is donated)."""
    recurrent, conv = (_onto(cache, a) for a in arrays)
    return dataclasses.replace(cache, pages=_scatter_state(cache.pages, recurrent, conv, jnp.int32(slot),
                                                           stages=cache.stages))
