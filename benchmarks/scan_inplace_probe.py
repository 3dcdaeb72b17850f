"""Probe for a fix to `engine.scan_layers` (models/pipeline.py `_sequential`), kept here
because benchmarks may not edit models/: delete once the model does this itself.

Today each scan row takes its layer's pages out of the carry (`dynamic_index_in_dim`,
which XLA materializes: a copy of one layer's pages) and writes them back
(`dynamic_update_index_in_dim`, a second copy), so every step moves the whole KV cache
twice. Here the carry is viewed as one pool `[L * N, page_size, 2H, D]` (a free reshape)
and row s reads and writes it directly, with its page ids shifted by s * N (slots by
s * N * page_size; padding slots stay -1): nothing is copied. This script patches
`_sequential` in-process, then: compiled temp bytes and compile time (the shapes of
compile_time.py), greedy tokens against the unrolled engine, and decode and prefill step
times as in scan_step_time.py, unrolled vs scan vs in-place scan, alternating.

    python benchmarks/scan_inplace_probe.py [--num-pages 2048] [--out benchmarks/results/scan_inplace_probe.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxfill.models.pipeline as pipeline


def sequential_in_place(layers, x, positions, pages, meta, impl, p):
    """`pipeline._sequential` with the stacked pages addressed as one pool (no row copies).
    x [T, E]; pages: entries [p, N, page_size, 2H, D]; returns rows [S, E] and pages."""
    graphdef, state = nnx.split(layers)
    shapes = [a.shape for a in pages]
    n, page_size = shapes[0][1], shapes[0][2]
    flat = tuple(a.reshape((-1,) + a.shape[2:]) for a in pages)  # [p * N, page_size, 2H, D]

    def body(carry, xs):
        x, flat = carry
        s, row = xs
        shifted = dataclasses.replace(
            meta, page_indices=meta.page_indices + s * n,
            slot_mapping=jnp.where(meta.slot_mapping >= 0, meta.slot_mapping + s * n * page_size, -1))
        x, flat = pipeline._run_layers(nnx.merge(graphdef, row), x, positions, flat, shifted, impl)
        return (x, flat), None

    (x, flat), _ = jax.lax.scan(body, (x, flat), (jnp.arange(p), state))
    return jnp.take(x, meta.logits_indices, axis=0), tuple(a.reshape(s) for a, s in zip(flat, shapes))


def temp_mib(config, stages: int) -> float:
    """Compiled temp bytes of the 16x16 step (benchmarks/compile_time.py), MiB."""
    import compile_time

    row = compile_time.compile_step(compile_time.step_args(config, stages, (16, 16)))
    return row["temp_bytes"] / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-pages", type=int, default=0)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--decode-steps", type=int, default=30)
    p.add_argument("--out", default="benchmarks/results/scan_inplace_probe.json")
    args = p.parse_args()
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    import compile_time
    from scan_step_time import build, decode_step_seconds, prefill_seconds, prompts

    from jaxfill.engine.config import load_config
    from jaxfill.engine.request import SamplingParams

    jax.config.update("jax_enable_compilation_cache", False)
    jax.monitoring.register_event_duration_secs_listener(compile_time._on_event)
    tiny = load_config("tiny_random")
    original = pipeline._sequential
    temp = {"unrolled": temp_mib(tiny, 1), "scan": temp_mib(tiny, tiny.model.num_layers)}
    pipeline._sequential = sequential_in_place
    temp["scan_in_place"] = temp_mib(tiny, tiny.model.num_layers)
    print(f"tiny_random 16x16 step temp MiB: {temp}", flush=True)
    compiles = []  # the in-place scan keeps compile_time.py's flat compile time?
    for name, preset, extra in compile_time.SHAPES:
        config = load_config(preset, extra)
        row = compile_time.compile_step(compile_time.step_args(config, config.model.num_layers, (256, 16)))
        compiles.append({"model": name, "layers": config.model.num_layers, "bucket": [256, 16], **row})
        print(f"in-place scan {name}: compile {row['total_s']:.1f} s, temp {row['temp_bytes'] / 2**20:.1f} MiB",
              flush=True)
    pipeline._sequential = original
    jax.clear_caches()

    engines = {"unrolled": build("bench", False, 512, args.num_pages)}
    engines["scan"] = build("bench", True, 512, args.num_pages)
    # The jitted step is cached by (graphdef, shapes): one more page gives the patched
    # program its own cache entry, traced at this engine's warm-up; the others keep theirs.
    pipeline._sequential = sequential_in_place
    engines["scan_in_place"] = build("bench", True, 512, engines["scan"].settings.num_pages + 1)
    rng = np.random.default_rng(0)
    check = prompts(rng, 4, 40)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tokens = {n: [c.token_ids for c in e.generate(check, greedy)] for n, e in engines.items()}
    same = all(t == tokens["unrolled"] for t in tokens.values())
    print(f"greedy tokens equal across the three: {same}", flush=True)
    decode = {n: [] for n in engines}
    prefill = {n: [] for n in engines}
    for r in range(args.rounds):
        ids = prompts(rng, 16, 128)
        long = prompts(rng, 2, 512)
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        for name in order:
            decode[name] += decode_step_seconds(engines[name], ids, args.decode_steps)
            prefill[name] += [prefill_seconds(engines[name], x) for x in long]
        print(f"round {r + 1}: " + ", ".join(f"{n} decode {1e3 * statistics.median(decode[n]):.1f} ms prefill "
                                              f"{1e3 * statistics.median(prefill[n]):.0f} ms" for n in engines),
              flush=True)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "jax": jax.__version__, "loadavg": os.getloadavg(), "num_pages": engines["scan"].settings.num_pages,
              "temp_mib_tiny_16x16": temp,
              "greedy_tokens_equal": same,
              "decode_16_seqs_step_median_ms": {n: 1e3 * statistics.median(v) for n, v in decode.items()},
              "prefill_512_median_ms": {n: 1e3 * statistics.median(v) for n, v in prefill.items()},
              "in_place_compile_256x16": compiles}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
