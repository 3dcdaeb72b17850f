"""`jaxfill bench serve`'s workload: requests, arrival times, and the two senders (gRPC, or
straight into an in-process EngineLoop), each recording what a client sees per request."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time

import numpy as np


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
    zipf = float(getattr(args, "prefix_repetition_zipf", 0.0) or 0.0)
    if zipf > 0:  # RAG-shaped: a few documents asked about often, a long tail rarely
        weights = 1.0 / np.arange(1, len(prefixes) + 1) ** zipf
        picks = rng.choice(len(prefixes), size=args.num_prompts, p=weights / weights.sum())
    else:
        picks = np.arange(args.num_prompts) % len(prefixes)
    reqs = []
    for i in picks:
        suffix = rng.integers(0, hi, size=args.prefix_repetition_suffix_len).tolist()
        reqs.append(BenchRequest(prefixes[i] + suffix, args.prefix_repetition_output_len))
    if zipf <= 0:
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
