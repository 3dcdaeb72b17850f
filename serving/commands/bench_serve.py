"""`jaxfill bench serve`: a gRPC load generator in the shape of `vllm bench serve`.

Workloads: `random` (input/output lengths with --random-range-ratio, optional shared
--random-prefix-len) and `prefix_repetition` (N shared prefixes, unique suffixes).
Arrivals: --request-rate (inf = all at once) with gamma inter-arrival times whose
shape is --burstiness (1 = Poisson), capped by --max-concurrency. Optional warm-up
requests and probe requests (a short request every --probe-interval seconds during the
run, reported separately: what a newcomer waits behind the load). The JSON uses vLLM's
key names (mean_ttft_ms, median_tpot_ms, p99_itl_ms, request_throughput, ...).

Targets:
    --address HOST:PORT         a running `jaxfill serve` (127.0.0.1)
    (no --address)              starts a server in this process from --config/--set
    --inprocess-baseline        also runs the same workload straight through the engine
                                (no gRPC) in this process first, and reports the per-token
                                streaming overhead: gRPC minus in-process, at p50.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import sys
import time
from datetime import datetime

import numpy as np

COMMAND = ("bench", "serve")
HELP = "gRPC serving load benchmark (vLLM bench serve metrics: TTFT/TPOT/ITL/E2E, throughput, goodput)"


def add_arguments(p) -> None:
    from jaxfill.serving.cli import common_model_args

    common_model_args(p)
    p.add_argument("--address", default=None, help="HOST:PORT of a running server; default: start one in-process")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset-name", default="random", choices=["random", "prefix_repetition"])
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=64)
    p.add_argument("--random-output-len", type=int, default=16)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-prefix-len", type=int, default=0, help="shared prefix prepended to every prompt")
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    p.add_argument("--prefix-repetition-suffix-len", type=int, default=32)
    p.add_argument("--prefix-repetition-num-prefixes", type=int, default=4)
    p.add_argument("--prefix-repetition-output-len", type=int, default=16)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrival times (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--num-warmups", type=int, default=0)
    p.add_argument("--probe-interval", type=float, default=0.0, help="seconds between probe requests (0 = none)")
    p.add_argument("--probe-input-len", type=int, default=16)
    p.add_argument("--probe-output-len", type=int, default=4)
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs, e.g. ttft:500 tpot:50 e2el:2000")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    p.add_argument("--num-channels", type=int, default=1, help="gRPC channels the streams are spread over")
    p.add_argument("--request-timeout", type=float, default=600.0, help="per-request deadline (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inprocess-baseline", action="store_true",
                   help="also run the workload in-process (no gRPC) and report the streaming overhead")
    p.add_argument("--max-duration", type=float, default=1800.0, help="hard cap on the measured run (s)")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=None, help="default: a new jaxfill-bench/serve-<time>/")
    p.add_argument("--result-filename", default=None)
    p.add_argument("--label", default="", help="free text stored in the JSON")
    p.add_argument("--plot", action="store_true", help="with --save-result: also write a PNG next to the JSON")


# ------------------------------------------------------------------------ workload
@dataclasses.dataclass
class BenchRequest:
    prompt: list[int]
    output_len: int
    probe: bool = False


@dataclasses.dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float = 0.0
    start: float = 0.0
    error: str = ""
    cached_tokens: int = 0
    probe: bool = False
    delivery: list[float] = dataclasses.field(default_factory=list)  # engine step end -> client, per chunk


def _lens(rng, mean: int, ratio: float, n: int) -> np.ndarray:
    lo, hi = max(int(mean * (1 - ratio)), 1), max(int(mean * (1 + ratio)), 1)
    return rng.integers(lo, hi + 1, size=n)


def build_requests(args, vocab_size: int) -> list[BenchRequest]:
    rng = np.random.default_rng(args.seed)
    hi = min(vocab_size, 256) if vocab_size > 256 else vocab_size  # byte ids for byte tokenizers
    hi = max(hi, 2)
    if args.dataset_name == "random":
        prefix = rng.integers(0, hi, size=args.random_prefix_len).tolist()
        ins = _lens(rng, args.random_input_len, args.random_range_ratio, args.num_prompts)
        outs = _lens(rng, args.random_output_len, args.random_range_ratio, args.num_prompts)
        # Like vLLM: offset each prompt's ids so no two prompts are the same sequence.
        return [BenchRequest(prefix + ((rng.integers(0, hi) + i + np.arange(n)) % hi).tolist(), int(o))
                for i, (n, o) in enumerate(zip(ins, outs))]
    prefixes = [rng.integers(0, hi, size=args.prefix_repetition_prefix_len).tolist()
                for _ in range(args.prefix_repetition_num_prefixes)]
    reqs = []
    for i in range(args.num_prompts):
        suffix = rng.integers(0, hi, size=args.prefix_repetition_suffix_len).tolist()
        reqs.append(BenchRequest(prefixes[i % len(prefixes)] + suffix, args.prefix_repetition_output_len))
    rng.shuffle(reqs)
    return reqs


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    if math.isinf(rate) or rate <= 0:
        return [0.0] * n
    rng = np.random.default_rng(seed + 1)
    theta = 1.0 / (rate * burstiness)
    return rng.gamma(shape=burstiness, scale=theta, size=n).tolist()


# ------------------------------------------------------------------- senders
class GrpcSender:
    def __init__(self, address: str, api_key: str | None, num_channels: int, timeout: float):
        from jaxfill.serving.client import AsyncClient

        self.clients = [AsyncClient(address, api_key=api_key) for _ in range(max(num_channels, 1))]
        self.timeout = timeout
        self.n = 0

    async def close(self):
        for c in self.clients:
            await c.close()

    async def vocab_size(self) -> int:
        return (await self.clients[0].model_info()).vocab_size

    async def __call__(self, req: BenchRequest) -> RequestResult:
        import grpc

        client = self.clients[self.n % len(self.clients)]
        self.n += 1
        res = RequestResult(prompt_len=len(req.prompt), probe=req.probe)
        res.start = start = time.monotonic()
        last = None
        try:
            call = client.stream(req.prompt, timeout=self.timeout, max_tokens=req.output_len, ignore_eos=True)
            async for resp in call:
                if resp.HasField("chunk"):
                    now = time.monotonic()
                    res.delivery.append(now - resp.chunk.step_time)
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.output_tokens += len(resp.chunk.token_ids)
                else:
                    res.cached_tokens = resp.complete.cached_tokens
                    res.success = resp.complete.finish_reason in ("length", "stop")
                    if not res.success:
                        res.error = f"finish_reason={resp.complete.finish_reason}"
            res.latency = time.monotonic() - start
        except grpc.aio.AioRpcError as e:
            res.error = f"{e.code().name}: {e.details()}"
        return res


class InProcessSender:
    """The same workload straight into an EngineLoop in this process: no gRPC, no protobuf."""

    def __init__(self, engine):
        from jaxfill.serving.engine_loop import EngineLoop

        self.engine = engine
        self.loop = EngineLoop(engine)
        self.n = 0

    async def start(self):
        ready = asyncio.Event()
        aio = asyncio.get_running_loop()
        self.loop.start(aio, warmup=True, on_ready=ready.set)
        await ready.wait()

    async def close(self):
        await asyncio.get_running_loop().run_in_executor(None, self.loop.stop)

    async def vocab_size(self) -> int:
        return int(self.engine.config.model.vocab_size)

    async def __call__(self, req: BenchRequest) -> RequestResult:
        from jaxfill.engine.request import SamplingParams

        res = RequestResult(prompt_len=len(req.prompt), probe=req.probe)
        res.start = start = time.monotonic()
        self.n += 1
        rid = f"inproc-{self.n}"
        stream = self.loop.submit(req.prompt, SamplingParams(max_tokens=req.output_len, ignore_eos=True), rid)
        last = None
        while True:
            kind, out, t = await stream.queue.get()
            if kind != "output":
                res.error = f"{kind}: {out}"
                return res
            if out.new_token_ids or out.new_text:
                now = time.monotonic()
                res.delivery.append(now - t)
                if last is None:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
                res.output_tokens += len(out.new_token_ids)
            if out.finished:
                c = out.completion
                res.cached_tokens = c.cached_tokens if c else 0
                res.success = c is None or c.finish_reason in ("length", "stop")
                res.latency = time.monotonic() - start
                return res


# ------------------------------------------------------------------- driver
async def run_workload(send, requests: list[BenchRequest], args, probe_len: tuple[int, int] | None):
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    gaps = arrival_gaps(len(requests), args.request_rate, args.burstiness, args.seed)

    async def one(req):
        if sem is None:
            return await send(req)
        async with sem:
            return await send(req)

    done = asyncio.Event()
    probes: list[asyncio.Task] = []

    async def prober():
        rng = np.random.default_rng(args.seed + 7)
        while not done.is_set():
            try:
                await asyncio.wait_for(done.wait(), args.probe_interval)
                return
            except asyncio.TimeoutError:
                pass
            prompt = rng.integers(0, 256, size=probe_len[0]).tolist()
            probes.append(asyncio.create_task(send(BenchRequest(prompt, probe_len[1], probe=True))))

    start = time.monotonic()
    probe_task = asyncio.create_task(prober()) if probe_len and args.probe_interval > 0 else None
    tasks = []
    for req, gap in zip(requests, gaps):
        if gap:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one(req)))
    try:
        results = await asyncio.wait_for(asyncio.gather(*tasks), args.max_duration)
    finally:
        duration = time.monotonic() - start
        done.set()
        if probe_task:
            await probe_task
    probe_results = list(await asyncio.gather(*probes)) if probes else []
    return list(results), probe_results, duration


def _stats(values_s: list[float], name: str, percentiles: list[float]) -> dict:
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    out = {}
    if arr.size == 0:
        arr = np.zeros(1)
    out[f"mean_{name}_ms"] = float(arr.mean())
    out[f"median_{name}_ms"] = float(np.median(arr))
    out[f"std_{name}_ms"] = float(arr.std())
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def calculate_metrics(results: list[RequestResult], duration: float, percentiles: list[float],
                      goodput: dict[str, float] | None) -> dict:
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    e2els = [r.latency for r in ok]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    m = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": total_out / duration if duration else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration else 0.0,
        "total_cached_tokens": sum(r.cached_tokens for r in ok),
    }
    if goodput:
        good = 0
        for r in ok:
            tpot = (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
            if (r.ttft * 1e3 <= goodput.get("ttft", math.inf) and tpot * 1e3 <= goodput.get("tpot", math.inf)
                    and r.latency * 1e3 <= goodput.get("e2el", math.inf)):
                good += 1
        m["request_goodput"] = good / duration if duration else 0.0
        m["goodput_slo_ms"] = goodput
    for values, name in ((ttfts, "ttft"), (tpots, "tpot"), (itls, "itl"), (e2els, "e2el")):
        m.update(_stats(values, name, percentiles))
    # Engine step returned -> chunk in the client's hands (same host, CLOCK_MONOTONIC).
    m.update(_stats([x for r in ok for x in r.delivery], "delivery", sorted(set(percentiles) | {50.0})))
    return m


def _parse_goodput(items) -> dict[str, float] | None:
    if not items:
        return None
    out = {}
    for item in items:
        key, _, val = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not val:
            raise ValueError(f"--goodput takes ttft:MS tpot:MS e2el:MS, got {item!r}")
        out[key] = float(val)
    return out


def print_report(title: str, m: dict) -> None:
    w = 50
    print("{s:{c}^{n}}".format(s=f" {title} ", n=w, c="="))
    rows = [("Successful requests", m["completed"]), ("Failed requests", m["failed"]),
            ("Benchmark duration (s)", f"{m['duration']:.2f}"), ("Total input tokens", m["total_input_tokens"]),
            ("Total generated tokens", m["total_output_tokens"]),
            ("Request throughput (req/s)", f"{m['request_throughput']:.2f}")]
    if "request_goodput" in m:
        rows.append(("Request goodput (req/s)", f"{m['request_goodput']:.2f}"))
    rows += [("Output token throughput (tok/s)", f"{m['output_throughput']:.2f}"),
             ("Total token throughput (tok/s)", f"{m['total_token_throughput']:.2f}")]
    for k, v in rows:
        print(f"{k:<40}{v:>10}")
    for name, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency"),
                        ("delivery", "Step end -> client (streaming overhead)")):
        print("{s:{c}^{n}}".format(s=label, n=w, c="-"))
        for k, v in m.items():
            if k.endswith(f"_{name}_ms") and not k.startswith("std"):
                print(f"{k:<40}{v:>10.2f}")
    print("=" * w, flush=True)


def plot(path: str, runs: dict[str, tuple[list[RequestResult], dict]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    for label, (results, _m) in runs.items():
        ok = [r for r in results if r.success]
        for ax, values in ((axes[0], [r.ttft * 1e3 for r in ok]),
                           (axes[1], [x * 1e3 for r in ok for x in r.itl]),
                           (axes[3], [x * 1e3 for r in ok for x in r.delivery])):
            if values:
                v = np.sort(values)
                ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label)
        axes[2].scatter([r.start - min(x.start for x in results) for r in ok], [r.latency * 1e3 for r in ok],
                        s=6, label=label)
    axes[0].set(xlabel="TTFT (ms)", ylabel="CDF", title="time to first token")
    axes[1].set(xlabel="inter-token latency (ms)", ylabel="CDF", title="inter-token latency")
    axes[2].set(xlabel="request start (s into run)", ylabel="end-to-end latency (ms)", title="E2E latency")
    axes[3].set(xlabel="engine step end -> client (ms)", ylabel="CDF", title="per-chunk delivery (streaming overhead)")
    axes[3].set_xscale("log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def _bench(args) -> dict:
    from jaxfill.serving.server import ServerThread

    percentiles = [float(x) for x in args.metric_percentiles.split(",") if x.strip()]
    goodput = _parse_goodput(args.goodput)
    engine = None
    server_thread = None
    runs: dict[str, tuple[list[RequestResult], dict]] = {}
    out: dict = {}
    if args.address is None or args.inprocess_baseline:
        from jaxfill.engine.engine import Engine

        engine = Engine.from_config(args.config, model_path=args.model, overrides=args.overrides, progress=False)

    if args.inprocess_baseline:
        sender = InProcessSender(engine)
        await sender.start()
        requests = build_requests(args, await sender.vocab_size())
        if args.num_warmups:
            await asyncio.gather(*[sender(r) for r in requests[:args.num_warmups]])
        results, probes, duration = await run_workload(sender, requests, args, None)
        await sender.close()
        m = calculate_metrics(results, duration, percentiles, goodput)
        print_report("in-process engine (no gRPC)", m)
        runs["in-process"] = (results, m)
        out["inprocess"] = m

    address = args.address
    if address is None:
        server_thread = ServerThread(engine, host="127.0.0.1", port=0)
        if not server_thread.wait_ready(1800):
            raise RuntimeError("in-process server did not become ready")
        address = server_thread.address
    sender = GrpcSender(address, args.api_key, args.num_channels, args.request_timeout)
    try:
        from jaxfill.serving.client import AsyncClient

        await AsyncClient(address, api_key=args.api_key).wait_serving(1800)
        info = await sender.clients[0].model_info()
        requests = build_requests(args, info.vocab_size)
        if args.num_warmups:
            await asyncio.gather(*[sender(r) for r in requests[:args.num_warmups]])
        results, probes, duration = await run_workload(
            sender, requests, args, (args.probe_input_len, args.probe_output_len))
    finally:
        await sender.close()
        if server_thread is not None:
            server_thread.stop(5)
    m = calculate_metrics(results, duration, percentiles, goodput)
    print_report("gRPC serving", m)
    runs["gRPC"] = (results, m)
    out.update(m)
    if probes:
        pm = calculate_metrics(probes, duration, percentiles, None)
        out["probe"] = {k: v for k, v in pm.items() if k.endswith("_ms") or k in ("completed", "failed")}
        print(f"probes: {pm['completed']} ok, {pm['failed']} failed, median TTFT {pm['median_ttft_ms']:.1f} ms, "
              f"p99 TTFT {pm['p99_ttft_ms']:.1f} ms")
    if "inprocess" in out:
        ip = out["inprocess"]
        out["streaming_overhead"] = {
            "median_delivery_ms_grpc": out["median_delivery_ms"],
            "median_delivery_ms_inprocess": ip["median_delivery_ms"],
            "median_delivery_overhead_ms": out["median_delivery_ms"] - ip["median_delivery_ms"],
            "p99_delivery_overhead_ms": out["p99_delivery_ms"] - ip["p99_delivery_ms"],
            "median_tpot_delta_ms": out["median_tpot_ms"] - ip["median_tpot_ms"],
            "median_itl_delta_ms": out["median_itl_ms"] - ip["median_itl_ms"],
            "median_ttft_delta_ms": out["median_ttft_ms"] - ip["median_ttft_ms"],
            "median_e2el_delta_ms": out["median_e2el_ms"] - ip["median_e2el_ms"],
        }
        so = out["streaming_overhead"]
        print("streaming overhead per token (gRPC - in-process, p50): "
              f"delivery {so['median_delivery_ms_grpc']:.3f} - {so['median_delivery_ms_inprocess']:.3f} = "
              f"{so['median_delivery_overhead_ms']:+.3f} ms; TPOT {so['median_tpot_delta_ms']:+.3f} ms, "
              f"ITL {so['median_itl_delta_ms']:+.3f} ms (TPOT/ITL deltas include run-to-run noise)")
    out["errors"] = sorted({r.error for r in results if r.error})[:20]
    out.update({
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "jaxfill-grpc", "label": args.label,
        "address": args.address or "in-process server", "config": args.config, "model_id": args.model or args.config,
        "overrides": list(args.overrides), "dataset_name": args.dataset_name, "num_prompts": args.num_prompts,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "num_channels": args.num_channels,
        "input_lens": [r.prompt_len for r in results], "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
    })
    out["_runs"] = runs
    return out


def run(args) -> int:
    if args.address is not None and not args.address.startswith(("127.0.0.1:", "localhost:", "[::1]:")):
        print(f"jaxfill bench serve: refusing non-loopback address {args.address}", file=sys.stderr)
        return 2
    from jaxfill.serving.bench_output import PLOTS_HINT, fresh_results_dir, have_matplotlib

    if args.plot and not have_matplotlib():
        raise ValueError(f"--plot: {PLOTS_HINT}")
    result = asyncio.run(_bench(args))
    runs = result.pop("_runs")
    if args.save_result:
        result_dir = args.result_dir or fresh_results_dir("serve")
        os.makedirs(result_dir, exist_ok=True)
        name = args.result_filename or f"serve_{args.dataset_name}_{result['date']}.json"
        path = os.path.join(result_dir, name)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")
        if args.plot:
            png = os.path.splitext(path)[0] + ".png"
            plot(png, runs, f"jaxfill bench serve: {args.config}, {args.dataset_name}, {args.num_prompts} requests, "
                            f"concurrency {args.max_concurrency}, rate {args.request_rate}")
            print(f"wrote {png}")
    return 0 if result["failed"] == 0 else 1
