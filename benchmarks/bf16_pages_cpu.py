"""bf16 KV pages on XLA:CPU: stored as bf16 (what every CPU engine did before 2026-12-07)
vs as their uint16 words (pallas_kernels/kv_cache.py), same process, same weights.

XLA:CPU runs a bf16 scatter (the KV write) and the attention loops' page gathers in f32
over the whole pool, so a bf16 step's cost and temporaries grew with the pool, not with the
context. Per (pool size, storage): one engine on SmolLM2-135M-Instruct's Q4_1 GGUF in its
default bf16 (tests/test_gguf_smollm2.py fetches it), the step program's temp bytes (XLA's
memory_analysis of the 16-token bucket) and decode ms/token at batch 1 (median of
--repeats generates of --tokens tokens after a 16-token prompt, first token excluded).
The bf16 storage is reproduced by handing KVCache.create the plain dtype.

    python benchmarks/bf16_pages_cpu.py [--pools 288 1152 4608] [--tokens 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "bf16_pages_cpu.json")
DEFAULT = os.path.join(os.path.expanduser("~"), ".cache", "jaxfill", "smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def measure(gguf: str, pages: int, storage: str, tokens: int, repeats: int) -> dict:
    import jax.numpy as jnp

    from jaxfill import Engine, SamplingParams
    from jaxfill.engine.config import load_config
    from jaxfill.models import kv_cache
    from jaxfill.pallas_kernels.kv_cache import page_storage_dtype

    kv_cache.page_storage_dtype = page_storage_dtype if storage == "words" else jnp.dtype
    try:
        over = [f"engine.num_pages={pages}", "engine.max_num_batched_tokens=64", "engine.token_buckets=[16, 64]",
                "engine.max_num_seqs=16", "engine.max_model_len=2048"]
        engine = Engine(load_config(overrides=over, model_path=gguf), progress=False)
    finally:
        kv_cache.page_storage_dtype = page_storage_dtype
    runner = engine.core.runner
    batch = runner.put(runner.dummy(runner.shapes[0]))
    with runner.mesh_context():
        compiled = runner.step_fn.lower(runner.static_graph, runner.state, runner.kv_cache, batch,
                                        runner.prev_tokens).compile()
    temp = int(compiled.memory_analysis().temp_size_in_bytes)
    prompt = list(range(100, 116))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    per_token, out = [], None
    for _ in range(repeats + 1):
        first = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
        start = time.perf_counter()
        out = engine.generate([prompt], params)[0]
        per_token.append((time.perf_counter() - start) / tokens)
        del first
    engine.close()
    return {"pages": pages, "storage": storage, "pool_bytes": int(sum(a.nbytes for a in runner.kv_cache.arrays())),
            "step_temp_bytes": temp, "decode_ms_per_token": 1e3 * statistics.median(per_token[1:]),
            "tokens": list(out.token_ids)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=DEFAULT)
    ap.add_argument("--pools", type=int, nargs="+", default=[288, 1152, 4608])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for pages in args.pools:
        for storage in ("bf16", "words"):
            r = measure(args.gguf, pages, storage, args.tokens, args.repeats)
            rows.append(r)
            print(f"pages {pages:5d} {storage:5s}: pool {r['pool_bytes'] / 1e6:7.1f} MB, step temps "
                  f"{r['step_temp_bytes'] / 1e6:7.1f} MB, decode {r['decode_ms_per_token']:6.1f} ms/token",
                  file=sys.stderr, flush=True)
    same = all(a["tokens"] == b["tokens"] for a, b in zip(rows[::2], rows[1::2]))
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_avg": os.getloadavg()[0],
              "gguf": os.path.basename(args.gguf), "rows": rows, "same_tokens": same}
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(result, f, indent=1)
    print(f"same tokens bf16 vs words: {same}; wrote {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main()
