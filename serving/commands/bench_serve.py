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
import json
import math
import os
import sys
from datetime import datetime

from jaxfill.serving.bench_load import GrpcSender, InProcessSender, RequestResult, build_requests, run_workload
from jaxfill.serving.bench_report import parse_goodput, calculate_metrics, plot, print_report

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
    p.add_argument("--prefix-repetition-zipf", type=float, default=0.0,
                   help="draw each request's prefix Zipf(s) over the prefixes (RAG-shaped); 0: round robin")
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


async def _bench(args) -> dict:
    from jaxfill.serving.server import ServerThread

    percentiles = [float(x) for x in args.metric_percentiles.split(",") if x.strip()]
    goodput = parse_goodput(args.goodput)
    engine = None
    server_thread = None
    runs: dict[str, tuple[list[RequestResult], dict]] = {}
    out: dict = {}
    if args.address is None or args.inprocess_baseline:
        from jaxfill.engine.engine import Engine

        engine = Engine.from_config(args.config, model_path=args.model, overrides=args.overrides, progress=False,
                                    compile_cache=args.compile_cache)  # None: --compile-cache none

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
            out["engine_stats"] = _prefill_stats(engine.stats(), results)
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
    config_name = engine.config.name if engine is not None else args.config  # a checkpoint's own name
    out.update({
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "jaxfill-grpc", "label": args.label,
        "address": args.address or "in-process server", "config": config_name,
        "model_id": args.model or config_name,
        "overrides": list(args.overrides), "dataset_name": args.dataset_name, "num_prompts": args.num_prompts,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "num_channels": args.num_channels,
        "input_lens": [r.prompt_len for r in results], "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
    })
    out["_runs"] = runs
    return out


def _prefill_stats(stats: dict, results: list[RequestResult]) -> dict:
    """What the in-process server's prefix cache and its tiers saved: prompt tokens that
    were actually prefilled (warm-ups and probes included), and the tiers' counters."""
    keep = {k: v for k, v in stats.items() if k.startswith(("host_kv_", "disk_kv_", "prefix_cache_"))
            or k in ("cached_tokens_total", "num_preemptions", "pages_total")}
    return {**keep, "prompt_tokens_measured": sum(r.prompt_len for r in results)}


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
            plot(png, runs, f"jaxfill bench serve: {result['config']}, {args.dataset_name}, "
                            f"{args.num_prompts} requests, concurrency {args.max_concurrency}, "
                            f"rate {args.request_rate}")
            print(f"wrote {png}")
    return 0 if result["failed"] == 0 else 1
