"""gRPC vs in-process time per step, paired on one engine (issue 51, item 5).

    python benchmarks/grpc_overhead.py [--config tiny] [--streams 8 32] [--tokens 128] [--rounds 5]
        [--profile loop|engine] [--out results/grpc_overhead.json]

Why paired: the box is shared and its load moves by 2x within minutes, so each round runs
the in-process EngineLoop (no gRPC, no protobuf: `serving/bench_load.InProcessSender`) and
then the gRPC server (`ServerThread`, a `GrpcSender` client in this process, as
`jaxfill bench serve` does) on the same warmed engine, back to back, and the figure is the
median over rounds of each round's gRPC / in-process ratio. Time per step = the round's
wall time (all N streams submitted at once, N x tokens out, `ignore_eos`) / tokens.

--profile loop|engine: cProfile one extra gRPC round on the server's event loop thread or
the engine thread (threading.setprofile is per thread, so the profiler is started inside
that thread) and print the top functions by own time.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import threading
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from jaxfill.engine.engine import Engine  # noqa: E402
from jaxfill.serving.bench_load import BenchRequest, GrpcSender, InProcessSender  # noqa: E402
from jaxfill.serving.server import ServerThread  # noqa: E402

def _requests(n: int, tokens: int, prompt_len: int, vocab: int, seed: int) -> list[BenchRequest]:
    hi = min(vocab, 256)
    return [BenchRequest([(seed * 131 + i * 7 + j) % hi for j in range(prompt_len)], tokens) for i in range(n)]


def _thread_cpu(engine_loop, server_thread) -> dict:
    """CPU seconds so far of the engine thread, the server's event loop thread (gRPC) and
    this thread (the client, or in-process the loop that dispatches and consumes)."""
    got, done = {}, threading.Event()
    engine_loop.call_on_engine(lambda: (got.setdefault("engine", time.thread_time()), done.set()))
    done.wait(30)
    if server_thread is not None:
        got["server_loop"] = server_thread.call(time.thread_time)
    got["client" if server_thread is not None else "loop"] = time.thread_time()
    return got


async def _round(send, reqs, engine_loop=None, server_thread=None) -> dict:
    t0 = _thread_cpu(engine_loop, server_thread) if engine_loop is not None else {}
    start, cpu0 = time.monotonic(), _cpu()
    results = await asyncio.gather(*[send(r) for r in reqs])
    wall, cpu = time.monotonic() - start, _cpu() - cpu0
    t1 = _thread_cpu(engine_loop, server_thread) if engine_loop is not None else {}
    bad = [r.error for r in results if not r.success]
    if bad:
        raise RuntimeError(f"failed requests: {bad[:3]}")
    tokens = reqs[0].output_len
    itl = sorted(x for r in results for x in r.itl)
    return {"wall_s": wall, "step_ms": 1e3 * wall / tokens, "cpu_ms": 1e3 * cpu / tokens,
            "median_itl_ms": 1e3 * itl[len(itl) // 2],
            "thread_cpu_ms": {k: 1e3 * (t1[k] - t0[k]) / tokens for k in t0}}


def _cpu() -> float:
    """CPU seconds of this whole process (every thread: engine, event loops, gRPC, XLA)."""
    t = os.times()
    return t.user + t.system


async def _inprocess(engine, reqs, profile: str | None = None) -> tuple[dict, str]:
    sender = InProcessSender(engine)
    await sender.start()
    prof = cProfile.Profile()
    try:
        if profile == "engine":
            sender.loop.call_on_engine(prof.enable)
        out = await _round(sender, reqs, sender.loop)
        if profile == "engine":
            done = threading.Event()
            sender.loop.call_on_engine(lambda: (prof.disable(), done.set()))
            done.wait(10)
    finally:
        await sender.close()
    return out, _stats_text(prof) if profile == "engine" else ""


def _stats_text(prof) -> str:
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    return buf.getvalue()


async def _grpc(engine, reqs, profile: str | None = None) -> tuple[dict, str]:
    st = ServerThread(engine, host="127.0.0.1", port=0)
    prof = cProfile.Profile()
    try:
        if not st.wait_ready(600):
            raise RuntimeError("server did not become ready")
        sender = GrpcSender(st.address, None, 1, 600.0)
        await _round(sender, reqs[:2])  # channel up
        if profile == "loop":
            st.call(prof.enable)
        elif profile == "engine":
            st.server.loop.call_on_engine(prof.enable)
        try:
            out = await _round(sender, reqs, st.server.loop, st)
        finally:
            if profile == "loop":
                st.call(prof.disable)
            elif profile == "engine":
                done = threading.Event()
                st.server.loop.call_on_engine(lambda: (prof.disable(), done.set()))
                st.server.loop._wake.set()
                done.wait(10)
        await sender.close()
    finally:
        st.stop(5)
    return out, _stats_text(prof) if profile else ""


async def main(args) -> dict:
    engine = Engine.from_config(args.config, overrides=args.set, progress=False)
    engine.warmup(progress=False)
    vocab = int(engine.config.model.vocab_size)
    out = {"config": args.config, "tokens": args.tokens, "load_before": os.getloadavg(), "by_streams": {}}
    for n in args.streams:
        reqs = _requests(n, args.tokens, args.prompt_len, vocab, 0)
        await _inprocess(engine, reqs[:2])  # every bucket and path touched once
        rows = []
        for r in range(args.rounds):
            reqs = _requests(n, args.tokens, args.prompt_len, vocab, r + 1)
            ip, _ = await _inprocess(engine, reqs)
            g, _ = await _grpc(engine, reqs)
            row = {"inprocess_step_ms": ip["step_ms"], "grpc_step_ms": g["step_ms"], "ratio": g["step_ms"] / ip["step_ms"],
                   "inprocess_cpu_ms": ip["cpu_ms"], "grpc_cpu_ms": g["cpu_ms"], "inprocess_itl_ms": ip["median_itl_ms"],
                   "grpc_itl_ms": g["median_itl_ms"], "load": os.getloadavg()[0],
                   **{f"inprocess_{k}_cpu_ms": v for k, v in ip["thread_cpu_ms"].items()},
                   **{f"grpc_{k}_cpu_ms": v for k, v in g["thread_cpu_ms"].items()}}
            rows.append(row)
            print(f"streams {n} round {r}: in-process {ip['step_ms']:.2f} ms/step, gRPC {g['step_ms']:.2f} ms/step, "
                  f"ratio {row['ratio']:.2f}; CPU ms/step {ip['cpu_ms']:.2f} vs {g['cpu_ms']:.2f}; "
                  f"load {row['load']:.1f}; threads {ip['thread_cpu_ms']} vs {g['thread_cpu_ms']}", flush=True)
        med = {k: statistics.median(x[k] for x in rows) for k in rows[0]}
        print(f"streams {n}: median in-process {med['inprocess_step_ms']:.2f}, gRPC {med['grpc_step_ms']:.2f} ms/step, "
              f"paired ratio {med['ratio']:.3f}; CPU ms/step {med['inprocess_cpu_ms']:.2f} vs "
              f"{med['grpc_cpu_ms']:.2f}; per thread " + ", ".join(f"{k} {v:.2f}" for k, v in med.items()
                                                                     if k.count("_") > 2), flush=True)
        out["by_streams"][str(n)] = {"rounds": rows, "median": med}
        if args.profile:
            _, text = await _grpc(engine, _requests(n, args.tokens, args.prompt_len, vocab, 99), args.profile)
            print(f"--- cProfile, {args.profile} thread, gRPC, {n} streams ---\n{text}", flush=True)
            if args.profile == "engine":
                _, text = await _inprocess(engine, _requests(n, args.tokens, args.prompt_len, vocab, 98), "engine")
                print(f"--- cProfile, engine thread, in-process, {n} streams ---\n{text}", flush=True)
    out["load_after"] = os.getloadavg()
    engine.close()
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny")
    p.add_argument("--set", nargs="*", default=[])
    p.add_argument("--streams", type=int, nargs="+", default=[8, 32])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--profile", choices=["loop", "engine"], default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    result = asyncio.run(main(a))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {a.out}")
