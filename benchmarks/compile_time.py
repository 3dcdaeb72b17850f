"""Cold start: compile time of one step's forward, layers unrolled (the model today) vs one
`jax.lax.scan` over stacked layer params and a stacked KV cache, for tiny, bench and a
32-layer llama3_8b-shaped model. Abstract weights and cache (ShapeDtypeStructs): nothing
is allocated, so the 8B shape compiles on a laptop. The persistent compile cache is off
and every compile is of a fresh jit, so each number is a real XLA compile.

The scan variant lives here only (a layout the engine does not use: every kernel and the
KV transfer take per-layer page arrays); on tiny_random it is first checked to give the
unrolled model's logits and cache on real weights, so the timing is of the same program.

    python benchmarks/compile_time.py [--tokens 256] [--seqs 16] [--out benchmarks/results/compile_time.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxfill.engine.batch import dummy_batch
from jaxfill.engine.config import load_config
from jaxfill.models.kv_cache import KVCache
from jaxfill.models.llama import DecoderLayer, Llama
from jaxfill.models.sharding import constrain

SHAPES = [("tiny", "tiny_random", {}), ("bench", "bench", {}), ("llama3_8b", "llama3_8b", {})]


def unrolled(graphdef, state, tokens, positions, kv_cache, meta):
    return nnx.merge(graphdef, state)(tokens, positions, kv_cache, meta)


def scanned(head_gd, head_state, layer_gd, layers,  # layers: every layer's params stacked [L, ...]
            tokens,  # [T] i32
            positions,  # [T] i32
            pages,  # [L, N, page_size, 2 * Hkv, D]
            meta):
    """Llama.__call__ with one scan over (layer params, layer pages)."""
    head = nnx.merge(head_gd, head_state)

    def body(x, xs):
        layer_state, layer_pages = xs
        x, layer_pages = nnx.merge(layer_gd, layer_state)(x, positions, layer_pages, meta, head.attention_impl)
        return x, layer_pages

    x, pages = jax.lax.scan(body, head.embed(tokens), (layers, pages))
    x = head.norm(constrain(jnp.take(x, meta.logits_indices, axis=0), ("seqs", "act_embed")))
    logits = head.embed.attend(x) if head.config.tie_word_embeddings else x @ head.lm_head[...]
    return logits.astype(jnp.float32), pages


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _stack(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def programs(config, tokens: int, seqs: int, num_pages: int = 64):
    """(unrolled args, scanned args) as ShapeDtypeStructs for one (tokens, seqs) bucket."""
    e = config.engine
    m = config.model
    batch = dummy_batch((tokens, seqs), e.max_pages_per_seq, e.penalty_window)
    inputs = _abstract((batch.tokens, batch.positions)) + (_abstract(batch.meta),)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(m, nnx.Rngs(0))))
    cache = jax.eval_shape(lambda: KVCache.create(m, num_pages, e.page_size))
    head_gd, head_state = nnx.split(nnx.eval_shape(lambda: Llama(dataclasses.replace(m, num_layers=1),
                                                                  nnx.Rngs(0))))
    layer_gd, layer_state = nnx.split(nnx.eval_shape(lambda: DecoderLayer(m, nnx.Rngs(0))))
    L = m.num_layers
    layers = jax.tree.map(lambda x: jax.ShapeDtypeStruct((L,) + x.shape, x.dtype), layer_state)
    page = cache.pages[0]
    pages = jax.ShapeDtypeStruct((L,) + page.shape, page.dtype)
    tok, pos, meta = inputs
    return ((graphdef, state, tok, pos, cache, meta),
            (head_gd, head_state, layer_gd, layers, tok, pos, pages, meta))


def compile_seconds(fn, static: tuple[int, ...], donate: int, args) -> dict:
    jitted = jax.jit(fn, static_argnums=static, donate_argnums=donate)  # a fresh jit: no cache
    t0 = time.perf_counter()
    lowered = jitted.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    mem = compiled.memory_analysis()
    return {"lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0,
            "temp_bytes": int(mem.temp_size_in_bytes) if mem is not None else None}


def check_same_program() -> float:
    """Max |logits diff| scan vs unrolled on tiny_random's real weights (pages NaN-filled
    outside the written slots); also asserts the caches agree where written."""
    from jaxfill.models.kv_cache import single_sequence_metadata

    config = load_config("tiny_random")
    m = config.model
    model = Llama(m, nnx.Rngs(m.seed))
    graphdef, state = nnx.split(model)
    ids = np.arange(1, 21, dtype=np.int32)
    meta = single_sequence_metadata(20, 0, [1, 2], 16, pad_to=32)
    tokens, positions = jnp.asarray(np.pad(ids, (0, 12))), jnp.arange(32, dtype=jnp.int32)
    cache = KVCache.create(m, 4, 16, fill_value=float("nan"))
    want, want_cache = jax.jit(unrolled, static_argnums=0)(graphdef, state, tokens, positions, cache, meta)
    head_gd, head_state = nnx.split(Llama(dataclasses.replace(m, num_layers=1), nnx.Rngs(m.seed)))
    head_state = nnx.State({**dict(head_state), "embed": state["embed"], "norm": state["norm"]})
    if "lm_head" in state:
        head_state["lm_head"] = state["lm_head"]
    layer_gd = nnx.split(model.layers[0])[0]
    layers = _stack([nnx.split(layer)[1] for layer in model.layers])
    got, got_pages = jax.jit(scanned, static_argnums=(0, 2))(head_gd, head_state, layer_gd, layers, tokens,
                                                             positions, jnp.stack(cache.pages), meta)
    for i, p in enumerate(want_cache.pages):
        np.testing.assert_array_equal(np.asarray(got_pages[i][1:3]), np.asarray(p[1:3]))
    diff = float(jnp.max(jnp.abs(got - want)))
    assert diff < 1e-4, diff
    return diff


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--only", default="", help="comma-separated subset of tiny,bench,llama3_8b")
    p.add_argument("--out", default="benchmarks/results/compile_time.json")
    args = p.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)
    diff = check_same_program()
    print(f"scan == unrolled on tiny_random: max |logits diff| {diff:.2e}", flush=True)
    rows = []
    for name, preset, extra in SHAPES:
        if args.only and name not in args.only.split(","):
            continue
        config = load_config(preset, {"engine.num_pages": 64, **extra})
        unrolled_args, scanned_args = programs(config, args.tokens, args.seqs)
        for variant, fn, static, donate, a in (("unrolled", unrolled, (0,), 4, unrolled_args),
                                               ("scan", scanned, (0, 2), 6, scanned_args)):
            r = {"model": name, "layers": config.model.num_layers, "dtype": config.model.dtype,
                 "variant": variant, "bucket": [args.tokens, args.seqs], **compile_seconds(fn, static, donate, a)}
            rows.append(r)
            print(json.dumps(r), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"jax": jax.__version__, "backend": jax.default_backend(), "cpu": platform.processor() or
                   platform.machine(), "cores": os.cpu_count(), "scan_vs_unrolled_max_logit_diff": diff,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
