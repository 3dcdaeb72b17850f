"""Pipeline parallelism (issue 16): bubbles, per-device bytes, boundary bytes vs tensor parallelism.

    python benchmarks/pipeline.py [--tokens 1024] [--repeats 3] [--only bubble,profile,bytes,hlo]
    python benchmarks/pipeline.py --tables      # markdown tables of results/pipeline.json

Three measurements on configs/bench.toml's model (8 layers, hidden 512, f32), each run in
a fresh subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=N set before jax
starts, and --xla_cpu_multi_thread_eigen=false so that one fake device is one thread:

* bubble: one prefill of `tokens` tokens (one sequence) through the pipelined forward for
  p = 2, 4 stages and m microbatches, wall time (median of repeats). The useful work of a
  stage ("busy") is timed apart: the same K = L/p layers on one device, run over the same
  m chunks of T/m tokens (chunk i attends to the (i+1)*T/m keys it sees in the pipeline).
  bubble_measured = 1 - busy / wall, next to the GPipe prediction (p-1)/(m+p-1). Busy is
  the useful work timed alone (run 1 was taken while fill/drain ticks still ran the
  layers on masked rows; models/parallel/pipeline.py now skips them with lax.cond).
  With more fake devices than cores the stages cannot all run at once; the core-normalised
  figure 1 - p * busy / (min(p, cores) * wall) is the idle share of the physical cores.
  bubble_cpu = 1 - devices * busy_cpu / cpu uses CPU seconds (all threads) instead of
  wall: the share of the pipeline's compute that is not useful work, which other load
  on a shared machine barely moves (wall time it moves a lot: loadavg is recorded). With
  skipped ticks costing no CPU it no longer measures the schedule (RESULTS.md, run 2).
* profile: one traced prefill (jax.profiler) for p=2 (m=4, 8) and p=4 (m=4); per stage,
  the busy time of its ops between consecutive ppermutes (one tick each), rendezvous waits
  taken out, split into useful ticks, fill/drain ticks, and the LM head's all-gather and
  copy before the loop; bubble_profile = 1 - useful / window.
* bytes: per-device weight and KV bytes vs stage count: device 0's shards of the real
  arrays for bench.toml, and shard shapes of the abstract llama3_8b.toml model (nothing
  allocated) for the 8B-shaped numbers.
* hlo: the forward compiled for stage=2 and for tensor=2 on the same model and tokens;
  collective-permute vs all-reduce bytes per token from the HLO (benchmarks/hlo_collectives.py;
  ops inside the pipeline's tick loop are multiplied by its m + p - 1 trips), next to the
  analytic per-token link bytes; plus a what-if compile with the LM head's output split
  over 'stage' (models/sharding.py RULES["act_vocab"] patched in this process only).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "configs", "bench.toml")
RESULTS = os.path.join(ROOT, "benchmarks", "results")
# (stages, fake devices, microbatch counts); devices == stages: one stage per device
BUBBLE_RUNS = [(2, 2, (1, 2, 4, 8)), (4, 4, (1, 4, 8)), (2, 8, (4,)), (4, 8, (4,))]


def _prefill(cfg, page_size: int, tokens: int, start: int, seed: int = 0):
    """Tokens [T] i32, positions [T] i32 and metadata of tokens [start, start+T) of one sequence."""
    import jax.numpy as jnp
    import numpy as np

    from jaxfill.models.kv_cache import single_sequence_metadata

    pages = list(range(1, (start + tokens) // page_size + 2))
    meta = single_sequence_metadata(tokens, start, pages, page_size)
    tok = jnp.asarray(np.random.RandomState(seed).randint(0, cfg.vocab_size, tokens).astype(np.int32))
    return tok, jnp.arange(start, start + tokens, dtype=jnp.int32), meta


def _timed(fn, repeats: int) -> tuple[float, float]:
    """Median (wall seconds, CPU seconds of all this process's threads) of fn() over
    `repeats` calls after one warm-up call. CPU time barely moves with other load on the
    machine; wall time does."""
    import numpy as np

    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        start, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    return float(np.median(walls)), float(np.median(cpus))


def stage_busy_s(cfg, page_size: int, tokens: int, stages: int, microbatches: int,
                 repeats: int) -> tuple[float, float]:
    """(Wall, CPU) seconds of one stage's useful work alone on one device: K = L/p layers over the m
    chunks of T/m tokens the pipeline feeds it (plus an embedding gather and a one-row head)."""
    import jax

    from jaxfill.models.forward import forward
    from jaxfill.models.kv_cache import KVCache
    from jaxfill.models.decoder import Decoder
    from flax import nnx

    part = dataclasses.replace(cfg, num_layers=cfg.num_layers // stages)
    graphdef, state = nnx.split(Decoder(part, nnx.Rngs(0)))
    n = tokens // microbatches
    chunks = [_prefill(cfg, page_size, n, i * n, seed=i) for i in range(microbatches)]
    box = [KVCache.create(part, tokens // page_size + 2, page_size, fill_value=float("nan"))]

    def run():
        for tok, pos, meta in chunks:
            logits, box[0] = forward(graphdef, state, tok, pos, box[0], meta)
        jax.block_until_ready(logits)
    return _timed(run, repeats)


def bubble(tokens: int, repeats: int, stages: int, microbatch_counts: list[int]) -> list[dict]:
    import jax

    from jaxfill.engine.config import MeshSettings, load_config
    from jaxfill.engine.mesh import make_mesh
    from jaxfill.models.execution_plan import ExecutionPlan
    from jaxfill.engine.placement import abstract_state, init_sharded
    from jaxfill.models.kv_cache import KVCache
    from jaxfill.models.forward import forward

    config = load_config(BENCH)
    cfg, page_size = config.model, config.engine.page_size
    devices = len(jax.devices())
    data = devices // stages
    mesh = make_mesh(MeshSettings(stage=stages, data=data))
    _, state = init_sharded(cfg, mesh, plan=ExecutionPlan.stacked(stages))
    tok, pos, meta = _prefill(cfg, page_size, tokens, 0)
    if data > 1:  # one prefill per 'data' replica, metadata stacked [data, ...]
        import jax.numpy as jnp
        import numpy as np

        from jaxfill.models.forward import forward_data_parallel as fn
        tok, pos = jnp.tile(tok, data), jnp.tile(pos, data)
        meta = jax.tree.map(lambda x: np.stack([x] * data), meta)
    else:
        fn = forward
    rows = []
    for m in microbatch_counts:
        graphdef, _ = abstract_state(cfg, plan=ExecutionPlan.stacked(stages, m))
        box = [KVCache.create(cfg, tokens // page_size + 2, page_size, fill_value=float("nan"),
                               stages=stages, mesh=mesh)]
        with jax.set_mesh(mesh):
            compiled = fn.lower(graphdef, state, tok, pos, box[0], meta).compile()

            def run():
                logits, box[0] = compiled(state, tok, pos, box[0], meta)
                logits.block_until_ready()
            wall, cpu = _timed(run, repeats)
        busy, busy_cpu = stage_busy_s(cfg, page_size, tokens, stages, m, repeats)
        cores = os.cpu_count() or 1
        row = {"stages": stages, "devices": devices, "data": data, "microbatches": m, "tokens_per_replica": tokens,
               "wall_s": wall, "stage_busy_s": busy, "cpu_s": cpu, "stage_busy_cpu_s": busy_cpu,
               "predicted_bubble": (stages - 1) / (m + stages - 1),
               "bubble_measured": 1 - busy / wall,
               "bubble_core_normalised": 1 - devices * busy / (min(devices, cores) * wall),
               "bubble_cpu": 1 - devices * busy_cpu / cpu,
               "loadavg_1min": os.getloadavg()[0]}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def profile(tokens: int, stages: int, microbatches: int) -> dict:
    """One pipelined prefill traced with jax.profiler; per-stage busy time from the trace."""
    import glob
    import tempfile

    import jax
    from pipeline_trace import stage_profile

    from jaxfill.engine.config import MeshSettings, load_config
    from jaxfill.engine.mesh import make_mesh
    from jaxfill.models.execution_plan import ExecutionPlan
    from jaxfill.engine.placement import abstract_state, init_sharded
    from jaxfill.models.kv_cache import KVCache
    from jaxfill.models.forward import forward

    config = load_config(BENCH)
    cfg, page_size = config.model, config.engine.page_size
    mesh = make_mesh(MeshSettings(stage=stages))
    _, state = init_sharded(cfg, mesh, plan=ExecutionPlan.stacked(stages))
    graphdef, _ = abstract_state(cfg, plan=ExecutionPlan.stacked(stages, microbatches))
    tok, pos, meta = _prefill(cfg, page_size, tokens, 0)
    cache = KVCache.create(cfg, tokens // page_size + 2, page_size, fill_value=float("nan"), stages=stages, mesh=mesh)
    logdir = tempfile.mkdtemp(prefix="pipeline_trace_")
    with jax.set_mesh(mesh):
        compiled = forward.lower(graphdef, state, tok, pos, cache, meta).compile()
        for traced in (False, True):  # warm-up, then the traced run
            if traced:
                jax.profiler.start_trace(logdir)
            start = time.perf_counter()
            logits, cache = compiled(state, tok, pos, cache, meta)
            logits.block_until_ready()
            wall = time.perf_counter() - start
        jax.profiler.stop_trace()
    trace = glob.glob(os.path.join(logdir, "**", "*.trace.json.gz"), recursive=True)[0]
    result = {"stages": stages, "microbatches": microbatches, "tokens": tokens, "wall_s_traced": wall,
              "loadavg_1min": os.getloadavg()[0], "per_stage": stage_profile(trace, stages, microbatches)}
    print(json.dumps(result), file=sys.stderr, flush=True)
    return result


def single_device_wall(tokens: int, repeats: int) -> dict:
    """The unpipelined model on one device: the wall a perfect p-stage pipeline divides by p."""
    from jaxfill.engine.config import load_config

    config = load_config(BENCH)
    wall, cpu = stage_busy_s(config.model, config.engine.page_size, tokens, 1, 1, repeats)
    return {"stages": 1, "devices": 1, "microbatches": 1, "tokens_per_replica": tokens, "wall_s": wall, "cpu_s": cpu,
            "loadavg_1min": os.getloadavg()[0]}


def _device0_bytes(tree) -> int:
    import jax

    dev = jax.devices()[0]
    return sum(s.data.nbytes for a in jax.tree.leaves(tree) for s in a.addressable_shards if s.device == dev)


def _abstract_bytes(cfg, stages: int, num_pages: int, page_size: int) -> dict:
    """Device 0's weight and KV bytes of `cfg` on `stages` stages, from shard shapes only."""
    import jax
    import numpy as np

    from jaxfill.engine.config import MeshSettings
    from jaxfill.engine.mesh import make_mesh
    from jaxfill.models.execution_plan import ExecutionPlan
    from jaxfill.engine.placement import abstract_state
    from jaxfill.models.sharding import kv_cache_heads, kv_cache_sharding, param_shardings

    mesh = make_mesh(MeshSettings(stage=stages), devices=jax.devices()[:stages])
    _, abstract = abstract_state(cfg, plan=ExecutionPlan.stacked(stages))
    shardings = param_shardings(abstract, mesh)
    leaves, shards = jax.tree.leaves(abstract), jax.tree.leaves(shardings)  # ShapeDtypeStruct, NamedSharding
    weights = sum(int(np.prod(s.shard_shape(v.shape))) * np.dtype(v.dtype).itemsize for v, s in zip(leaves, shards))
    entry = ((stages,) if stages > 1 else ()) + (num_pages, page_size, 2 * kv_cache_heads(cfg, mesh), cfg.head_dim)
    kv_sharding = kv_cache_sharding(mesh, staged=stages > 1)
    kv = (cfg.num_layers // stages) * int(np.prod(kv_sharding.shard_shape(entry))) * np.dtype(cfg.jnp_dtype).itemsize
    return {"weight_bytes_device0": int(weights), "kv_bytes_device0": int(kv)}


def per_device_bytes(num_pages: int) -> dict:
    import jax

    from jaxfill.engine.config import MeshSettings, load_config
    from jaxfill.engine.mesh import make_mesh
    from jaxfill.models.execution_plan import ExecutionPlan
    from jaxfill.engine.placement import init_sharded
    from jaxfill.models.kv_cache import KVCache

    bench = load_config(BENCH)
    cfg, page_size = bench.model, bench.engine.page_size
    rows = {"bench_arrays": [], "llama3_8b_abstract": [], "bench_abstract": []}
    for p in (1, 2, 4, 8):
        mesh = make_mesh(MeshSettings(stage=p), devices=jax.devices()[:p])
        _, state = init_sharded(cfg, mesh, plan=ExecutionPlan.stacked(p))
        cache = KVCache.create(cfg, num_pages, page_size, stages=p, mesh=mesh)
        row = {"stages": p, "weight_bytes_device0": _device0_bytes(state), "kv_bytes_device0": _device0_bytes(cache)}
        rows["bench_arrays"].append(row)
        rows["bench_abstract"].append({"stages": p, **_abstract_bytes(cfg, p, num_pages, page_size)})
        print(json.dumps(row), file=sys.stderr, flush=True)
        del state, cache
    big = load_config(os.path.join(ROOT, "configs", "llama3_8b.toml")).model
    for p in (1, 2, 4, 8):
        row = {"stages": p, **_abstract_bytes(big, p, num_pages, page_size)}
        rows["llama3_8b_abstract"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return {"num_pages": num_pages, "page_size": page_size, "llama3_8b_dtype": big.dtype, **rows}


def per_op_bytes(hlo_text: str) -> list[dict]:
    """Every collective in compiled HLO text: its kind, bytes (hlo_collectives' rules) and
    whether it sits in a while body (the pipeline's tick loop), where it runs once per trip."""
    import re

    from hlo_collectives import COLLECTIVES, collective_ops

    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo_text))
    ops, computation = [], None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$", line)
        if head:
            computation = head.group(1)
            continue
        counts = collective_ops(line)
        for op in COLLECTIVES:
            if counts[op]:
                shape = re.search(r"=\s*(.*?)\s" + op, line)
                ops.append({"op": op, "bytes": counts[op + "_bytes"], "in_loop": computation in bodies,
                            "result": shape.group(1) if shape else "", "computation": computation})
    return ops


def boundary_vs_tensor(tokens: int, microbatches: int) -> dict:
    import jax

    from jaxfill.engine.config import MeshSettings, load_config
    from jaxfill.engine.mesh import make_mesh
    from jaxfill.models.execution_plan import ExecutionPlan
    from jaxfill.engine.placement import abstract_state, init_sharded
    from jaxfill.models.kv_cache import KVCache
    from jaxfill.models.forward import forward
    from hlo_collectives import collective_ops
    from jaxfill.models.sharding import RULES, STAGE, TENSOR

    config = load_config(BENCH)
    cfg, page_size = config.model, config.engine.page_size
    tok, pos, meta = _prefill(cfg, page_size, tokens, 0)
    saved = RULES["act_vocab"]
    out = {}
    variants = (("stage2", MeshSettings(stage=2), None), ("tensor2", MeshSettings(tensor=2), None),
                ("stage2_logits_split_over_stage", MeshSettings(stage=2), (TENSOR, STAGE)))
    for name, settings, act_vocab in variants:
        stages = settings.stage
        # what-if (benchmark only): the LM head's output split over 'stage' like its weight
        RULES["act_vocab"] = act_vocab or saved
        jax.clear_caches()  # the rules are read at trace time
        mesh = make_mesh(settings, devices=jax.devices()[:2])
        _, state = init_sharded(cfg, mesh, plan=ExecutionPlan.stacked(stages))
        graphdef, _ = abstract_state(cfg, plan=ExecutionPlan.stacked(stages, microbatches))
        cache = KVCache.create(cfg, tokens // page_size + 2, page_size, stages=stages, mesh=mesh)
        with jax.set_mesh(mesh):
            text = forward.lower(graphdef, state, tok, pos, cache, meta).compile().as_text()
        ops = per_op_bytes(text)
        trips = microbatches + stages - 1 if stages > 1 else 1
        executed = {}
        for op in ops:  # bytes actually moved: ops in the tick loop run once per tick
            k = op["op"]
            executed[k] = executed.get(k, 0) + op["bytes"] * (trips if op["in_loop"] else 1)
        out[name] = {"static": {k: v for k, v in collective_ops(text).items() if v}, "ops": ops,
                     "executed_bytes_per_token": {k: v / tokens for k, v in executed.items()}}
        print(json.dumps({name: out[name]["executed_bytes_per_token"]}), file=sys.stderr, flush=True)
    RULES["act_vocab"] = saved
    return {"tokens": tokens, "microbatches": microbatches, **out, "analytic": analytic_link_bytes()}


def analytic_link_bytes() -> dict:
    """Bytes per token over the link between two devices (or hosts): a pipeline boundary
    carries the [E] activation once; tensor parallelism all-reduces [E] twice per layer,
    and a ring all-reduce sends 2 (tp-1)/tp of it from each device."""
    from jaxfill.engine.config import load_config

    out = {}
    for name in ("bench", "llama3_8b", "llama3_70b"):
        cfg = load_config(os.path.join(ROOT, "configs", name + ".toml")).model
        b = cfg.hidden_size * __import__("numpy").dtype(cfg.jnp_dtype).itemsize
        tp = 2
        out[name] = {"hidden": cfg.hidden_size, "layers": cfg.num_layers, "dtype": cfg.dtype,
                     "pipeline_boundary_bytes_per_token": b,
                     "tensor2_allreduce_bytes_per_token": 2 * cfg.num_layers * 2 * (tp - 1) / tp * b}
    return out


def _child(args) -> None:
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    if args.child == "bubble":
        result = bubble(args.tokens, args.repeats, args.stages, [int(m) for m in args.microbatches.split(",")])
    elif args.child == "single":
        result = single_device_wall(args.tokens, args.repeats)
    elif args.child == "profile":
        result = profile(args.tokens, args.stages, int(args.microbatches))
    elif args.child == "bytes":
        result = per_device_bytes(args.num_pages)
    else:
        result = boundary_vs_tensor(args.tokens, 4)
    print("RESULT " + json.dumps(result), flush=True)


def _spawn(devices: int, *extra: str) -> object:
    flags = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
             " --xla_cpu_multi_thread_eigen=false").strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *extra], env=env, stdout=subprocess.PIPE,
                          text=True)
    if proc.returncode:
        raise RuntimeError(f"child {extra} failed with exit code {proc.returncode}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-pages", type=int, default=512)
    ap.add_argument("--only", default="bubble,profile,bytes,hlo")
    ap.add_argument("--out", default=os.path.join(RESULTS, "pipeline.json"))
    ap.add_argument("--tables", action="store_true", help="print the result file's markdown tables and exit")
    ap.add_argument("--child", choices=("bubble", "single", "profile", "bytes", "hlo"), help=argparse.SUPPRESS)
    ap.add_argument("--stages", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--microbatches", default="4", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(args)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from pipeline_report import plot, tables
    if args.tables:
        with open(args.out) as f:
            return print(tables(json.load(f)))
    import jax

    common = ["--tokens", str(args.tokens), "--repeats", str(args.repeats), "--num-pages", str(args.num_pages)]
    result = {}
    if os.path.exists(args.out):  # keep the sections not rerun
        with open(args.out) as f:
            result = json.load(f)
    result.update({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "jax": jax.__version__, "cores": os.cpu_count(), "model": "configs/bench.toml",
                   "xla_flags": "--xla_cpu_multi_thread_eigen=false (one thread per fake device)"})

    def save(section, value):
        result[section] = value
        result.setdefault("loadavg", {})[section] = os.getloadavg()
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"{section} -> {args.out}", flush=True)
    only = args.only.split(",")
    if "bubble" in only:
        save("single_device", _spawn(1, "--child", "single", *common))
        rows = []
        for p, devices, ms in BUBBLE_RUNS:
            for m in ms:  # a fresh process per configuration
                rows += _spawn(devices, "--child", "bubble", "--stages", str(p), "--microbatches", str(m), *common)
                print(json.dumps(rows[-1]), flush=True)
        save("bubble", rows)
    if "bubble" in result:
        plot(result["bubble"], os.path.join(RESULTS, "pipeline_bubble.png"))
    if "profile" in only:
        save("profile", [_spawn(p, "--child", "profile", "--stages", str(p), "--microbatches", str(m), *common)
                         for p, m in ((2, 4), (2, 8), (4, 4))])
    if "bytes" in only:
        save("per_device_bytes", _spawn(8, "--child", "bytes", *common))
    if "hlo" in only:
        save("boundary_vs_tensor", _spawn(2, "--child", "hlo", *common))


if __name__ == "__main__":
    main()
