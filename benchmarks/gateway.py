"""What the smg gateway costs per token, and what a second worker behind it adds (issue 12).

The same workload (random ASCII prompts, greedy, ignore_eos so every request makes
exactly --output-len tokens, streaming) three ways, each with a fresh set of processes:
  direct      vllm.grpc.engine.VllmEngine.Generate straight to one `jaxfill serve` worker
  smg x1      the openai client -> `smg launch` (HTTP, tokenizes, detokenizes) -> that worker
  smg x2      the same through smg over two workers (--policy round_robin)
Latency at concurrency 1 (p50/p99 TTFT and ITL: the per-request and per-token cost of
the extra hop), throughput at --concurrency (output tokens/s). Loopback only.
Writes benchmarks/results/gateway.json.

    python benchmarks/gateway.py [--requests 32] [--output-len 32] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from gateway_util import SmgProcess, kill_all, start_worker  # noqa: E402

SETTINGS = ["engine.num_pages=512", "engine.max_model_len=512", "engine.max_num_seqs=16"]


def prompts(n: int, length: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz     "
    return ["".join(rng.choice(letters) for _ in range(length)) for _ in range(n)]


def direct_request(address: str, output_len: int):
    """One streaming Generate over the worker's vllm protocol: (TTFT s, [token arrival s], tokens)."""
    import grpc
    from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

    channel = grpc.insecure_channel(address)
    stub = vpb_grpc.VllmEngineStub(channel)
    counter = iter(range(1 << 62))

    def run(prompt: str):
        req = vpb.GenerateRequest(
            request_id=f"bench-{threading.get_ident()}-{next(counter)}", stream=True,
            tokenized=vpb.TokenizedInput(original_text=prompt, input_ids=list(prompt.encode())),
            sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
        start, arrivals, tokens = time.perf_counter(), [], 0
        for resp in stub.Generate(req, timeout=120):
            if resp.HasField("chunk") and resp.chunk.token_ids:
                arrivals.append(time.perf_counter() - start)
                tokens += len(resp.chunk.token_ids)
        return arrivals, tokens

    return run


def gateway_request(gateway: SmgProcess, output_len: int):
    import openai

    client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=120)

    def run(prompt: str):
        start, arrivals, tokens = time.perf_counter(), [], 0
        stream = client.completions.create(model=gateway.model, prompt=prompt, max_tokens=output_len,
                                           temperature=0, stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                arrivals.append(time.perf_counter() - start)
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return arrivals, tokens

    return run


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def measure(run, texts: list[str], concurrency: int) -> dict:
    run(texts[0])  # warm the connection
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(run, texts))
    elapsed = time.perf_counter() - start
    ttft = [a[0] for a, _ in results if a]
    itl = [b - a for arrivals, _ in results for a, b in zip(arrivals, arrivals[1:])]
    tokens = sum(n for _, n in results)
    return {"concurrency": concurrency, "requests": len(texts), "output_tokens": tokens, "elapsed_s": elapsed,
            "output_tokens_per_s": tokens / elapsed,
            "ttft_ms": {"p50": 1e3 * percentile(ttft, 50), "p99": 1e3 * percentile(ttft, 99)},
            "itl_ms": {"p50": 1e3 * percentile(itl, 50), "p99": 1e3 * percentile(itl, 99)}}


def scenario(name: str, num_workers: int, via_gateway: bool, args, texts) -> dict:
    settings = [a for s in SETTINGS for a in ("--set", s)]
    workers, gateway = [], None
    try:
        workers = [start_worker(None, *settings) for _ in range(num_workers)]
        if via_gateway:
            gateway = SmgProcess([w.address for w in workers], "round_robin")
            run = gateway_request(gateway, args.output_len)
        else:
            run = direct_request(workers[0].address, args.output_len)
        out = {"name": name, "workers": num_workers, "via_gateway": via_gateway,
               "latency": measure(run, texts[: args.latency_requests], 1),
               "throughput": measure(run, texts, args.concurrency)}
        print(json.dumps(out), flush=True)
        return out
    finally:
        kill_all(gateway, *workers)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--latency-requests", type=int, default=12)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "gateway.json"))
    args = p.parse_args()
    texts = prompts(args.requests, args.input_len)
    runs = [scenario("direct", 1, False, args, texts), scenario("smg x1", 1, True, args, texts),
            scenario("smg x2", 2, True, args, texts)]
    result = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "config": "tiny",
              "worker_settings": SETTINGS, "args": vars(args), "runs": runs}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for r in runs:
        lat, thr = r["latency"], r["throughput"]
        print(f"{r['name']:8s} TTFT p50 {lat['ttft_ms']['p50']:.1f} p99 {lat['ttft_ms']['p99']:.1f} ms | "
              f"ITL p50 {lat['itl_ms']['p50']:.2f} p99 {lat['itl_ms']['p99']:.2f} ms | "
              f"{thr['output_tokens_per_s']:.0f} tok/s at concurrency {thr['concurrency']}")


if __name__ == "__main__":
    main()
