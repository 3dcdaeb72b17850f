"""Pass-KV ring vs pass-Q for fresh prompts under mesh.sequence (models/parallel/context.py).

For each prompt length S (one unchunked prefill, nothing cached, so `pass_kv` takes the
ring) and each mode (`model.context_attention` = pass_kv | pass_q), on N fake CPU devices:
the median prefill wall time of 3 fresh prompts after one compile run, and the bytes the
compiled step's collectives move (benchmarks/hlo_collectives.py): the ring's
collective-permutes vs pass-Q's all-gathers, all-max and reduce-scatter. Wall time on 2
shared CPU cores says how the two modes' compute compares here (the ring's dense blocks
against the paged kernel), not what an interconnect would do; the bytes are what would
cross the links on a TPU or GPU.

    python benchmarks/context_modes.py            # writes benchmarks/results/context_modes.json
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
LENGTHS = (1024, 2048, 4096, 8192)
DEVICES = 4


def measure(mode: str, length: int) -> dict:
    import numpy as np

    sys.path.insert(0, HERE)
    from jaxfill.engine.config import load_config
    from jaxfill.engine.engine import Engine
    from jaxfill.engine.request import SamplingParams

    over = {"mesh.sequence": DEVICES, "model.context_attention": mode, "engine.enable_prefix_caching": False,
            "model.max_position_embeddings": 16384, "engine.max_model_len": 16384,
            "engine.max_num_batched_tokens": length, "engine.token_buckets": [length],
            "engine.max_num_seqs": 1, "engine.seq_buckets": [1], "engine.num_pages": 4 * (length // 16 + 8)}
    engine = Engine(load_config("tiny_random", over), progress=False, warmup=False)
    rng = np.random.default_rng(length)
    prompt = lambda: [int(x) for x in rng.integers(0, 256, length - 1)]  # noqa: E731 - + bos = length
    params = SamplingParams(max_tokens=1)
    engine.generate([prompt()], params)  # compiles
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        engine.generate([prompt()], params)
        times.append(time.perf_counter() - t0)
    return {"mode": mode, "length": length, "median_s": statistics.median(times), "times_s": times,
            "collectives": step_collectives(engine.config, length)}


def step_collectives(config, length: int) -> dict:
    """Collectives of the model forward for one fresh `length`-token prefill, compiled
    alone (forward.lower, as benchmarks/sharding.py does). Under `pass_kv` the program holds
    both modes (lax.cond): the ring's bytes are its collective-permutes."""
    import jax
    import jax.numpy as jnp

    from hlo_collectives import collective_ops
    from jaxfill.engine.mesh import make_mesh
    from jaxfill.engine.placement import init_sharded
    from jaxfill.models.forward import forward
    from jaxfill.models.kv_cache import KVCache, dealt_pages, single_sequence_metadata

    cfg, page_size = config.model, config.engine.page_size
    mesh = make_mesh(config.mesh, devices=jax.devices()[:DEVICES])
    graphdef, state = init_sharded(cfg, mesh, config.engine.attention_impl)
    num_pages = config.engine.num_pages
    cache = KVCache.create(cfg, num_pages, page_size, mesh=mesh)
    meta = single_sequence_metadata(length, 0, dealt_pages(length // page_size, num_pages, DEVICES), page_size)
    tok, pos = jnp.zeros(length, jnp.int32), jnp.arange(length, dtype=jnp.int32)
    with jax.set_mesh(mesh):
        compiled = forward.lower(graphdef, state, tok, pos, cache, meta).compile()
    return collective_ops(compiled.as_text())


def main():
    rows = []
    for length in LENGTHS:
        for mode in ("pass_kv", "pass_q"):
            env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}",
                       JAX_PLATFORMS="cpu")
            out = subprocess.run([sys.executable, __file__, mode, str(length)], env=env, capture_output=True,
                                 text=True, timeout=1200)
            if out.returncode:
                raise SystemExit(out.stderr[-3000:])
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"S={length:6d} {mode:7s} median {row['median_s'] * 1e3:8.1f} ms", flush=True)
    path = os.path.join(HERE, "results", "context_modes.json")
    with open(path, "w") as f:
        json.dump({"devices": DEVICES, "model": "tiny_random", "rows": rows}, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    if len(sys.argv) == 3:
        print(json.dumps(measure(sys.argv[1], int(sys.argv[2]))))
    else:
        main()
