"""Causal prefill attention on CPU: jaxfill (impl "auto" = xla on CPU) vs torch SDPA(is_causal=True).

    python benchmarks/attention_cpu.py [--seq 2048 8192] [--rounds 3] [--repeats 5] [--devices 1 2]
    python benchmarks/attention_cpu.py --pin 1      # per core: one pinned core, CPU time

Shape: one sequence, 8 q heads / 2 KV heads / head_dim 64, f32 (the DESIGN.md bench
shape). jaxfill reads K/V from a paged cache (page_size 16, pages in shuffled order);
torch gets contiguous [1, H, S, D] tensors (its best case). Each framework runs in its own
subprocess (no shared thread pools), and the pair is run `--rounds` times alternating,
so slow phases of a shared machine hit both; each process reports the median of
`--repeats` timed calls after warm-up, and the table shows the median over rounds.
`--devices N` runs jaxfill on N XLA CPU devices (--xla_force_host_platform_device_count)
with the heads split over them by `shard_map`, the layout the engine uses with
mesh.tensor = N; 1 is the plain single-device call. `--pin CORE` compares per-core
efficiency: every process on CORE, torch 1 thread, process CPU time.
Writes benchmarks/results/attention_cpu.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "attention_cpu.json")
HQ, HKV, D, PAGE = 8, 2, 64, 16
# Measured to help the polynomial exp2 / softmax passes on AVX2 (see RESULTS.md).
JAX_XLA_FLAGS = "--xla_cpu_prefer_vector_width=512"


def flops(seq: int) -> float:
    """Causal attention FLOPs (QK^T and PV, lower triangle incl. diagonal)."""
    return 4.0 * HQ * D * seq * (seq + 1) / 2


def time_calls(fn, repeats: int) -> list[float]:
    """Wall seconds per call; process CPU seconds when pinned (PIN_CLOCK=cpu)."""
    clock = time.process_time if os.environ.get("PIN_CLOCK") == "cpu" else time.perf_counter
    fn()
    fn()
    out = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


def worker_torch(seq: int, repeats: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HQ, seq, D, generator=g)
    k = torch.randn(1, HKV, seq, D, generator=g)
    v = torch.randn(1, HKV, seq, D, generator=g)
    if os.environ.get("PIN_CLOCK") == "cpu":
        torch.set_num_threads(1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with torch.inference_mode():
        times = time_calls(lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True), repeats)
    return {"times_s": times, "threads": torch.get_num_threads(), "version": torch.__version__}


def paged_inputs(seq: int):
    """q [seq, HQ, D], pages [seq / PAGE, PAGE, 2 * HKV, D] in shuffled order, and the
    metadata (kv_lens, page_indices, cu_q_lens, num_seqs) of one causal prefill."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    num_pages = seq // PAGE
    q = jnp.asarray(rng.standard_normal((seq, HQ, D), np.float32))
    pages = jnp.asarray(rng.standard_normal((num_pages, PAGE, 2 * HKV, D), np.float32))
    page_indices = jnp.asarray(rng.permutation(num_pages)[None].astype(np.int32))
    meta = (jnp.asarray([seq], jnp.int32), page_indices, jnp.asarray([0, seq], jnp.int32),
            jnp.asarray([1], jnp.int32))
    return q, pages, meta


def worker_jax(seq: int, repeats: int, impl: str, devices: int) -> dict:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    sys.path.insert(0, ROOT)
    from jaxfill.pallas_kernels import ragged_paged_attention

    q, pages, meta = paged_inputs(seq)
    attend = lambda q, pages, *m: ragged_paged_attention(q, pages, *m, sm_scale=D ** -0.5, impl=impl)
    if devices > 1:  # heads split over the devices, as models/parallel/context.py sharded_attention does
        mesh = Mesh(np.array(jax.devices()[:devices]), ("tensor",))
        head_spec, page_spec = P(None, "tensor", None), P(None, None, "tensor", None)
        attend = jax.shard_map(attend, mesh=mesh, in_specs=(head_spec, page_spec) + (P(),) * 4,
                               out_specs=head_spec, check_vma=False)
        q = jax.device_put(q, NamedSharding(mesh, head_spec))
        pages = jax.device_put(pages, NamedSharding(mesh, page_spec))
        meta = tuple(jax.device_put(m, NamedSharding(mesh, P())) for m in meta)
    fn = jax.jit(attend)
    times = time_calls(lambda: fn(q, pages, *meta).block_until_ready(), repeats)
    return {"times_s": times, "devices": len(jax.devices()), "version": jax.__version__,
            "xla_flags": os.environ.get("XLA_FLAGS", "")}


def run_worker(framework: str, seq: int, repeats: int, impl: str, devices: int = 1, pin=None) -> dict:
    env = dict(os.environ)
    if pin is not None:
        env["PIN_CLOCK"] = "cpu"
    if framework == "jax":
        flags = f"{JAX_XLA_FLAGS} --xla_force_host_platform_device_count={devices}"
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", framework, "--seq",
           str(seq), "--repeats", str(repeats), "--impl", impl, "--devices", str(devices)]
    if pin is not None:
        cmd = ["taskset", "-c", str(pin)] + cmd
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--impl", default="auto", help="comma-separated impls to time")
    ap.add_argument("--devices", type=int, nargs="+", default=[1, os.cpu_count()],
                    help="XLA CPU device counts to time jaxfill on (heads split over them)")
    ap.add_argument("--pin", type=int, metavar="CORE", default=None,
                    help="per-core efficiency instead: every process on CORE (taskset), torch 1 thread, "
                         "jaxfill 1 device, process CPU time (disturbed far less by other jobs than wall time)")
    ap.add_argument("--worker", choices=["jax", "torch"])
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()
    if args.worker:
        res = (worker_jax(args.seq[0], args.repeats, args.impl, args.devices[0]) if args.worker == "jax"
               else worker_torch(args.seq[0], args.repeats))
        print(json.dumps(res))
        return

    if args.pin is not None:
        args.devices = [1]
    rows = []
    load_before = os.getloadavg()
    impls = args.impl.split(",")
    variants = [(impl, n) for impl in impls for n in args.devices]
    for seq in args.seq:
        repeats = args.repeats if seq <= 4096 else max(3, args.repeats // 2)
        per = {v: [] for v in variants + ["torch"]}
        meta = {}
        for _ in range(args.rounds):  # alternate: torch, then each jaxfill variant
            for v in ["torch"] + variants:
                r = (run_worker("torch", seq, repeats, "", pin=args.pin) if v == "torch"
                     else run_worker("jax", seq, repeats, v[0], v[1], pin=args.pin))
                per[v].append(statistics.median(r["times_s"]))
                meta[str(v)] = {k: x for k, x in r.items() if k != "times_s"}
        torch_ms = statistics.median(per["torch"]) * 1e3
        for impl, n in variants:
            jax_ms = statistics.median(per[(impl, n)]) * 1e3
            rows.append({
                "seq": seq, "impl": impl, "devices": n, "jax_ms": round(jax_ms, 2),
                "torch_ms": round(torch_ms, 2),
                "ratio_jax_over_torch": round(jax_ms / torch_ms, 3),
                "jax_gflops": round(flops(seq) / jax_ms / 1e6, 1),
                "torch_gflops": round(flops(seq) / torch_ms / 1e6, 1),
                "jax_round_medians_ms": [round(t * 1e3, 2) for t in per[(impl, n)]],
                "torch_round_medians_ms": [round(t * 1e3, 2) for t in per["torch"]],
                "meta": {"torch": meta["torch"], "jax": meta[str((impl, n))]},
            })
    result = {
        "benchmark": "causal prefill attention, 1 sequence, Hq=8 Hkv=2 D=64 f32",
        "jax_impls": impls, "devices": args.devices, "page_size": PAGE, "rounds": args.rounds,
        "repeats": args.repeats,
        "measure": "process CPU time, one pinned core" if args.pin is not None else "wall time", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": {
            "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
        "jax_xla_flags": JAX_XLA_FLAGS, "rows": rows,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{result['measure']}:")
    print("| seq | jaxfill impl | XLA devices | jaxfill ms | torch SDPA ms | jaxfill / torch | jaxfill GFLOP/s | torch GFLOP/s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['seq']} | {r['impl']} | {r['devices']} | {r['jax_ms']:.1f} | {r['torch_ms']:.1f} | "
              f"{r['ratio_jax_over_torch']:.2f} | {r['jax_gflops']:.0f} | {r['torch_gflops']:.0f} |")
    print(f"load average before/after: {result['machine']['loadavg_before']} / "
          f"{result['machine']['loadavg_after']}; wrote {os.path.relpath(args.out, ROOT)}")


if __name__ == "__main__":
    main()
