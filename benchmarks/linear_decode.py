"""One Gated DeltaNet layer's rule at Qwen3.5-9B shapes (32 value heads, k = v = 128,
state 2 MiB per sequence): a decode step of B sequences, B = 1, 16, 64, and one
512-token prefill, through the chunk loop as it was before decodes got their own path
(ragged_scan.py at OLD_COMMIT, loaded from git) and through `gated_delta_rule_chunked`
now. Both in one process, taking turns (the order flips every round); medians. The two
outputs are compared before timing.

    python benchmarks/linear_decode.py [--rounds 7] [--out benchmarks/results/linear_decode.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

from jaxfill.pallas_kernels import gated_delta_rule as gdr

OLD_COMMIT = "7c245ae"  # the last commit where a decode went through a 64-row chunk
H, D, CHUNK = 32, 128, 64


def old_scan_chunks():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = subprocess.run(["git", "-C", root, "show", f"{OLD_COMMIT}:pallas_kernels/ragged_scan.py"],
                         check=True, capture_output=True, text=True).stdout
    mod = types.ModuleType("old_ragged_scan")
    exec(compile(src, "old_ragged_scan.py", "exec"), mod.__dict__)
    return mod.scan_chunks


def paths() -> dict:
    old = old_scan_chunks()

    @jax.jit
    def before(q, k, v, g, beta, cu, ns, states):
        return old(gdr._chunk, (q, k, v, g, beta), cu, ns, states, CHUNK, v.shape[1:])

    after = jax.jit(lambda *a: gdr.gated_delta_rule_chunked(*a, chunk=CHUNK))
    return {"before": before, "after": after}


def batch(rng, lens: list[int]) -> tuple:
    t, s = sum(lens), len(lens)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    k = rng.standard_normal((t, H, D))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    return (f32(rng.standard_normal((t, H, D)) / np.sqrt(D)), f32(k), f32(rng.standard_normal((t, H, D))),
            f32(-rng.uniform(0.0, 0.5, (t, H))), f32(rng.uniform(0.0, 1.0, (t, H))),
            jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32), jnp.asarray([s], jnp.int32),
            f32(rng.standard_normal((s, H, D, D)) * 0.1))


def seconds(fn, args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default="benchmarks/results/linear_decode.json")
    a = p.parse_args()
    fns = paths()
    cases = {f"decode_b{b}": [1] * b for b in (1, 16, 64)} | {"prefill_512": [512]}
    rng = np.random.default_rng(0)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": "shared noisy 2-core CPU", "jax": jax.__version__, "old_commit": OLD_COMMIT,
              "shape": {"heads": H, "k": D, "v": D, "chunk": CHUNK}, "rounds": a.rounds, "cases": {}}
    for name, lens in cases.items():
        args = batch(rng, lens)
        outs = {k: jax.block_until_ready(f(*args)) for k, f in fns.items()}  # compile + check
        for x, y in zip(outs["before"], outs["after"]):
            np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=2e-3, atol=2e-3)
        times = {k: [] for k in fns}
        for r in range(a.rounds):
            for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                times[k].append(seconds(fns[k], args))
        med = {k: statistics.median(v) for k, v in times.items()}
        result["cases"][name] = {"median_ms": {k: round(v * 1e3, 3) for k, v in med.items()},
                                 "speedup": round(med["before"] / med["after"], 2),
                                 "all_ms": {k: [round(x * 1e3, 3) for x in v] for k, v in times.items()}}
        print(name, result["cases"][name]["median_ms"], result["cases"][name]["speedup"], flush=True)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
