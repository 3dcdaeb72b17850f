"""Small gRPC clients for the Generation API: async (load benchmark, tests) and sync (CLI).

    async with AsyncClient("127.0.0.1:50051") as c:
        result = await c.generate("Hello", max_tokens=8)
        async for resp in c.stream([1, 2, 3], max_tokens=8): ...

    with Client("127.0.0.1:50051") as c:
        for resp in c.stream("Hello", max_tokens=8): print(resp.chunk.text, end="")
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxfill.serving.proto.jaxfill.v1 import generation_pb2 as pb
from jaxfill.serving.proto.jaxfill.v1 import generation_pb2_grpc as pb_grpc

SAMPLING_FIELDS = {f.name for f in pb.SamplingParams.DESCRIPTOR.fields}
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def make_request(prompt, request_id: str = "", cache_salt: str = "", priority: int = 0, lora: str = "",
                 images=(), **sampling) -> pb.GenerateRequest:
    """prompt: text or a list of token ids; sampling: SamplingParams fields (None = unset);
    lora: a LoRA adapter the server loaded ("" = the base model); images: encoded image
    files (bytes), one <|image_pad|> each in the prompt (docs/vision.md)."""
    unknown = set(sampling) - SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling fields {sorted(unknown)}; known: {sorted(SAMPLING_FIELDS)}")
    if isinstance(sampling.get("choice"), (list, tuple)):
        sampling["choice"] = pb.Choices(choices=sampling["choice"])
    sp = pb.SamplingParams(**{k: v for k, v in sampling.items() if v is not None})
    req = pb.GenerateRequest(request_id=request_id, sampling=sp, cache_salt=cache_salt, priority=priority, lora=lora,
                             images=list(images))
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(int(t) for t in prompt)
    return req


@dataclasses.dataclass
class Result:
    token_ids: list[int]
    text: str
    finish_reason: str
    complete: pb.GenerateComplete
    chunk_times: list[float]  # time.monotonic() at each chunk's arrival
    start: float
    chunk_sizes: list[int] = dataclasses.field(default_factory=list)
    delivery_s: list[float] = dataclasses.field(default_factory=list)  # arrival - server step_time, per chunk

    @classmethod
    def empty(cls) -> "Result":
        return cls([], "", "", None, [], time.monotonic())

    def add(self, resp: pb.GenerateResponse) -> None:
        """Folds one streamed response in (sync and async clients share this)."""
        if resp.HasField("chunk"):
            now = time.monotonic()
            self.chunk_times.append(now)
            self.delivery_s.append(now - resp.chunk.step_time)
            self.chunk_sizes.append(len(resp.chunk.token_ids))
            self.token_ids.extend(resp.chunk.token_ids)
            self.text += resp.chunk.text
        else:
            self.complete = resp.complete
            self.finish_reason = resp.complete.finish_reason


def _metadata(api_key: str | None):
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


def _credentials(tls_ca: str | None):
    if tls_ca is None:
        return None
    with open(tls_ca, "rb") as f:
        return grpc.ssl_channel_credentials(root_certificates=f.read())


class AsyncClient:
    def __init__(self, address: str, api_key: str | None = None, tls_ca: str | None = None,
                 tls_server_name: str | None = None):
        creds = _credentials(tls_ca)
        options = list(CHANNEL_OPTIONS)
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        self.channel = (grpc.aio.secure_channel(address, creds, options=options) if creds
                        else grpc.aio.insecure_channel(address, options=options))
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.metadata = _metadata(api_key)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self):
        await self.channel.close()

    def stream(self, prompt, timeout: float | None = None, request_id: str = "", cache_salt: str = "",
               priority: int = 0, images=(), **sampling):
        """The raw response stream (a grpc.aio call: iterate it, or .cancel() it)."""
        req = make_request(prompt, request_id, cache_salt, priority, images=images, **sampling)
        return self.stub.Generate(req, timeout=timeout, metadata=self.metadata)

    async def generate(self, prompt, timeout: float | None = None, **kw) -> Result:
        result = Result.empty()
        async for resp in self.stream(prompt, timeout=timeout, **kw):
            result.add(resp)
        return result

    async def model_info(self) -> pb.ModelInfo:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata)

    async def abort(self, request_id: str) -> bool:
        return (await self.stub.Abort(pb.AbortRequest(request_id=request_id), metadata=self.metadata)).found

    async def tokenize(self, text: str, add_bos: bool | None = None) -> list[int]:
        req = pb.TokenizeRequest(text=text)
        if add_bos is not None:
            req.add_bos = add_bos
        return list((await self.stub.Tokenize(req, metadata=self.metadata)).token_ids)

    async def detokenize(self, ids) -> str:
        return (await self.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids), metadata=self.metadata)).text

    async def health(self, service: str = "") -> int:
        return (await self.health_stub.Check(health_pb2.HealthCheckRequest(service=service))).status

    async def wait_serving(self, timeout: float = 600.0, poll_s: float = 0.1) -> None:
        """Polls grpc.health.v1 until SERVING (warm-up done); TimeoutError after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if await self.health() == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not SERVING after {timeout:g} s")
            await asyncio.sleep(poll_s)


class Client:
    """Blocking client (CLI, quick scripts)."""

    def __init__(self, address: str, api_key: str | None = None, tls_ca: str | None = None,
                 tls_server_name: str | None = None):
        creds = _credentials(tls_ca)
        options = list(CHANNEL_OPTIONS)
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        self.channel = (grpc.secure_channel(address, creds, options=options) if creds
                        else grpc.insecure_channel(address, options=options))
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.metadata = _metadata(api_key)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self.channel.close()

    def stream(self, prompt, timeout: float | None = None, request_id: str = "", cache_salt: str = "",
               priority: int = 0, images=(), **sampling):
        req = make_request(prompt, request_id, cache_salt, priority, images=images, **sampling)
        return self.stub.Generate(req, timeout=timeout, metadata=self.metadata)

    def generate(self, prompt, timeout: float | None = None, **kw) -> Result:
        result = Result.empty()
        for resp in self.stream(prompt, timeout=timeout, **kw):
            result.add(resp)
        return result

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata)

    def health(self, service: str = "", timeout: float | None = None) -> int:
        return self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout).status

    def wait_serving(self, timeout: float = 600.0, poll_s: float = 0.1) -> None:
        """Polls grpc.health.v1 until SERVING (warm-up done); TimeoutError after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.health(timeout=max(min(5.0, deadline - time.monotonic()), 0.1)) == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not SERVING after {timeout:g} s")
            time.sleep(poll_s)
