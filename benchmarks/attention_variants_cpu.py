"""Kernel variants of the CPU attention (impl "xla") side by side, on one pinned core.

    taskset -c 1 python benchmarks/attention_variants_cpu.py --seq 8192 \\
        --variants "" "block_q=128,block_kv=128" "exp2_degree=5"

Each variant is keyword arguments to `ragged_paged_attention_xla` ("" = the defaults),
plus `exp2_degree=5`, which swaps in a degree-5 polynomial for the kernel's degree-6
exp2 (f32 relative error 2.4e-7 vs 1.0e-7) to see what the cheaper softmax would buy.
Inputs and shape are attention_cpu.py's (Hq 8 / Hkv 2 / D 64, f32, shuffled pages).
Variants alternate for --rounds rounds in one process; each prints the median process
CPU time of --repeats calls and its max |difference| from the first variant's output.
Compare against torch with `attention_cpu.py --pin 1` run in the same minutes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

# Near-minimax (relative error) fit of 2**f on [-0.5, 0.5], highest power first.
EXP2_DEGREE5 = (1.327647185289842e-3, 9.675541541028454e-3, 5.55071327573476e-2,
                2.4022119720050555e-1, 6.93146967062262e-1, 1.0000000716554385)


def exp2_degree5(x):
    """The kernel's exp2 with one polynomial term fewer (same range split)."""
    import jax.numpy as jnp
    from jax import lax

    x = jnp.maximum(x, -126.0)
    n = lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN)
    f = x - n
    p = jnp.float32(EXP2_DEGREE5[0])
    for c in EXP2_DEGREE5[1:]:
        p = p * f + jnp.float32(c)
    return p * lax.bitcast_convert_type((n.astype(jnp.int32) + 127) << 23, jnp.float32)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--variants", nargs="+", default=["", "block_q=128,block_kv=128", "exp2_degree=5"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from attention_cpu import D, paged_inputs
    from jaxfill.pallas_kernels.ragged_paged_attention import xla

    q, pages, meta = paged_inputs(args.seq)
    kernel_exp2 = xla.exp2
    medians, first = {v: [] for v in args.variants}, None
    for rnd in range(args.rounds):
        for v in args.variants:
            kw = dict(kv.split("=") for kv in v.split(",") if kv)
            xla.exp2 = exp2_degree5 if kw.pop("exp2_degree", "6") == "5" else kernel_exp2
            kw = {k: int(x) for k, x in kw.items()}
            # The unjitted kernel under a fresh jit: the module-level jit caches by its static
            # arguments only, so a swapped exp2 would hit the cached default trace.
            fn = jax.jit(lambda q, p, *m, kw=kw: xla.ragged_paged_attention_xla.__wrapped__(
                q, p, *m, sm_scale=D ** -0.5, **kw))
            out = fn(q, pages, *meta).block_until_ready()
            fn(q, pages, *meta).block_until_ready()
            first = out if first is None else first
            times = []
            for _ in range(args.repeats):
                t0 = time.process_time()
                fn(q, pages, *meta).block_until_ready()
                times.append(time.process_time() - t0)
            medians[v].append(statistics.median(times) * 1e3)
            print(f"round {rnd + 1}: {v or 'default':32s} {medians[v][-1]:8.1f} ms CPU  "
                  f"max |diff| {float(jnp.max(jnp.abs(out - first))):.1e}", flush=True)
    xla.exp2 = kernel_exp2
    print(f"seq {args.seq}, load {os.getloadavg()[0]:.1f}: round medians, ms CPU")
    for v, ms in medians.items():
        print(f"  {v or 'default':32s} " + " / ".join(f"{m:.0f}" for m in ms))


if __name__ == "__main__":
    main()
