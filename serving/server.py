"""gRPC server: jaxfill.v1.Generation, the JetStream Orchestrator shim, health, reflection.

Everything here runs on one asyncio event loop (grpc.aio); the Engine runs on the
EngineLoop's thread. Status codes:
    INVALID_ARGUMENT    bad input; the message starts with the offending field's name
    RESOURCE_EXHAUSTED  the waiting queue is at engine.max_waiting
    UNAVAILABLE         warming up (health NOT_SERVING), draining, or warm-up failed
    UNAUTHENTICATED     --api-key set and `authorization` metadata missing or wrong
    INTERNAL            this request's step failed; the server and other requests go on
A stream whose client cancels, disconnects or passes its deadline is aborted in the
engine before the next step (its pages freed at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import threading
import time
import uuid

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from jaxfill.engine.loading import validate_prompt
from jaxfill.engine.request import InvalidRequest, QueueFull, SamplingParams
from jaxfill.serving.engine_loop import DRAINING, FAILED, SERVING, STOPPED, WARMING, EngineLoop
from jaxfill.serving.metrics import ServerMetrics
from jaxfill.serving.proto.jaxfill.v1 import generation_pb2 as pb
from jaxfill.serving.proto.jaxfill.v1 import generation_pb2_grpc as pb_grpc
from jaxfill.serving.proto.jetstream.core.proto import jetstream_pb2 as js
from jaxfill.serving.proto.jetstream.core.proto import jetstream_pb2_grpc as js_grpc

log = logging.getLogger("jaxfill.serving")

GENERATION_SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # jaxfill.v1.Generation
ORCHESTRATOR_SERVICE = js.DESCRIPTOR.services_by_name["Orchestrator"].full_name  # jetstream_proto.Orchestrator
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
MAX_REQUEST_ID_LEN = 256
MAX_CACHE_SALT_LEN = 1024
MAX_STOP_STRINGS = 16
OFFLOAD_TEXT_CHARS = 4096  # tokenize longer texts off the event loop
DEFAULT_MAX_TOKENS = 16


class BadField(Exception):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


# Engine-side field names -> where they sit in the request message.
_PROMPT_FIELD = {"text": "text", "token_ids": "token_ids.ids"}


def _sampling_from_proto(s: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_tokens=s.max_tokens if s.max_tokens != 0 else DEFAULT_MAX_TOKENS,
        temperature=s.temperature, top_k=s.top_k,
        top_p=s.top_p if s.HasField("top_p") else 1.0, min_p=s.min_p,
        seed=s.seed if s.HasField("seed") else None, stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        logprobs=s.logprobs if s.HasField("logprobs") else None)


def _logprobs_to_proto(entries) -> list[pb.TokenLogprob]:
    """RequestOutput.logprobs entries -> TokenLogprob; tolerant of the dict spelling."""
    out = []
    for e in entries or ():
        if not isinstance(e, dict):
            continue
        tid = e.get("token_id", e.get("id", 0))
        top = e.get("top_logprobs", e.get("top", ()))
        if isinstance(top, dict):
            top = list(top.items())
        tops = []
        for item in top or ():
            if isinstance(item, dict):
                tops.append(pb.TopLogprob(token_id=int(item.get("token_id", item.get("id", 0))),
                                          logprob=float(item.get("logprob", 0.0))))
            else:
                tops.append(pb.TopLogprob(token_id=int(item[0]), logprob=float(item[1])))
        out.append(pb.TokenLogprob(token_id=int(tid), logprob=float(e.get("logprob", 0.0)), top=tops))
    return out


class _Core:
    """Request validation and the stream -> response plumbing both APIs share."""

    def __init__(self, engine, loop_: EngineLoop, metrics: ServerMetrics):
        self.engine = engine
        self.loop = loop_
        self.metrics = metrics
        cfg = engine.config
        self.vocab_size = int(cfg.model.vocab_size)
        self.max_model_len = int(cfg.engine.max_model_len)
        self.tokenizer = engine.tokenizer

    async def check_available(self, context) -> None:
        state = self.loop.state
        if state == SERVING:
            return
        why = {WARMING: "the server is warming up (compiling shape buckets); retry shortly",
               DRAINING: "the server is draining and refuses new requests",
               STOPPED: "the server is stopped",
               FAILED: f"warm-up failed: {self.loop.error}"}[state]
        await context.abort(grpc.StatusCode.UNAVAILABLE, why)

    async def encode(self, text: str) -> list[int]:
        if len(text) > OFFLOAD_TEXT_CHARS:
            return await asyncio.get_running_loop().run_in_executor(None, self.tokenizer.encode, text)
        return self.tokenizer.encode(text)

    def check_prompt(self, ids: list[int], field: str) -> None:
        try:
            validate_prompt(ids, self.vocab_size, self.max_model_len)
        except InvalidRequest as e:
            raise BadField(field, str(e).split(": ", 1)[-1]) from None

    def check_params(self, params: SamplingParams) -> SamplingParams:
        try:
            params.validate(self.vocab_size)
        except InvalidRequest as e:
            raise BadField(f"sampling.{e.field}", str(e).split(": ", 1)[-1]) from None
        if params.max_tokens > self.max_model_len:
            raise BadField("sampling.max_tokens",
                           f"{params.max_tokens} exceeds max_model_len ({self.max_model_len})")
        if len(params.stop) > MAX_STOP_STRINGS:
            raise BadField("sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(params.stop)}")
        return params

    async def run(self, context, ids: list[int], params: SamplingParams, request_id: str, priority: int,
                  arrival: float):
        """Submits and yields (kind, payload, stream) until finished; maps failures to status codes."""
        try:
            stream = self.loop.submit(ids, params, request_id, priority, arrival)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFull as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        try:
            while True:
                kind, payload, t = await stream.queue.get()
                if kind == "error":
                    if isinstance(payload, InvalidRequest):
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(payload))
                    if isinstance(payload, QueueFull):
                        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(payload) or "queue full")
                    self._observe(stream, "error", None, t)
                    await context.abort(grpc.StatusCode.INTERNAL, str(payload))
                if kind == "aborted":
                    self._observe(stream, "abort", None, t)
                    yield kind, None, stream, t
                    return
                yield kind, payload, stream, t
                if payload.finished:
                    c = payload.completion
                    reason = c.finish_reason if c is not None else "stop"
                    self._observe(stream, reason, c, t)
                    if reason == "error":
                        msg = (c.error if c is not None and c.error else "the engine step for this request failed")
                        await context.abort(grpc.StatusCode.INTERNAL, msg)
                    return
        finally:
            if not stream.done:  # cancelled, disconnected, deadline passed: free its pages now
                self.loop.abort(request_id)

    def _observe(self, stream, reason: str, completion, t: float) -> None:
        m = completion.metrics if completion is not None else {}
        ttft = stream.first_token_t - stream.arrival if stream.first_token_t is not None else None
        tpot = None
        if stream.num_tokens > 1 and stream.first_token_t is not None:
            tpot = (stream.last_token_t - stream.first_token_t) / (stream.num_tokens - 1)
        self.metrics.observe_finished(
            reason=reason, prompt_tokens=completion.prompt_tokens if completion else stream.prompt_tokens,
            completion_tokens=stream.num_tokens, cached_tokens=completion.cached_tokens if completion else 0,
            ttft_s=ttft, tpot_s=tpot, queue_s=m.get("queue_s"), prefill_s=m.get("prefill_s"),
            e2e_s=t - stream.arrival)

    def complete(self, stream, reason: str, completion) -> pb.GenerateComplete:
        m = completion.metrics if completion is not None else {}
        return pb.GenerateComplete(
            request_id=stream.request_id, finish_reason=reason,
            prompt_tokens=completion.prompt_tokens if completion else stream.prompt_tokens,
            completion_tokens=len(completion.token_ids) if completion else stream.num_tokens,
            cached_tokens=completion.cached_tokens if completion else 0,
            queue_time_s=float(m.get("queue_s", 0.0) or 0.0),
            ttft_s=(stream.first_token_t - stream.arrival) if stream.first_token_t is not None else 0.0,
            e2e_s=time.monotonic() - stream.arrival)


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, core: _Core):
        self.core = core

    async def Generate(self, request: pb.GenerateRequest, context):
        arrival = time.monotonic()
        core = self.core
        await core.check_available(context)
        try:
            rid = request.request_id or uuid.uuid4().hex
            if len(rid) > MAX_REQUEST_ID_LEN:
                raise BadField("request_id", f"longer than {MAX_REQUEST_ID_LEN} characters")
            which = request.WhichOneof("input")
            if which is None:
                raise BadField("input", "set either text or token_ids")
            if which == "text":
                if not request.text:
                    raise BadField("text", "is empty")
                ids = await core.encode(request.text)
            else:
                ids = list(request.token_ids.ids)
            core.check_prompt(ids, _PROMPT_FIELD[which])
            params = _sampling_from_proto(request.sampling)
            if len(request.cache_salt) > MAX_CACHE_SALT_LEN:
                raise BadField("cache_salt", f"longer than {MAX_CACHE_SALT_LEN} characters")
            if request.cache_salt:
                params = _replace(params, cache_salt=request.cache_salt)
            core.check_params(params)
        except BadField as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        async with contextlib.aclosing(core.run(context, ids, params, rid, request.priority, arrival)) as events:
            async for kind, out, stream, t in events:
                if kind == "aborted":
                    yield pb.GenerateResponse(complete=core.complete(stream, "abort", None))
                    return
                if out.new_token_ids or out.new_text:
                    chunk = pb.GenerateChunk(token_ids=out.new_token_ids, text=out.new_text, step_time=t)
                    if out.logprobs and params.logprobs is not None:
                        chunk.logprobs.extend(_logprobs_to_proto(out.logprobs))
                    yield pb.GenerateResponse(chunk=chunk)
                if out.finished:
                    c = out.completion
                    yield pb.GenerateResponse(complete=core.complete(stream, c.finish_reason if c else "stop", c))

    async def Abort(self, request: pb.AbortRequest, context):
        return pb.AbortResponse(found=self.core.loop.abort(request.request_id, notify=True))

    async def GetModelInfo(self, request, context):
        core = self.core
        cfg = core.engine.config
        stats = core.loop.stats()
        try:
            import jax

            devices = jax.devices()
            platform, ndev = devices[0].platform, len(devices)
        except Exception:  # noqa: BLE001
            platform, ndev = "", 0
        mesh = pb.MeshInfo(data=cfg.mesh.data, tensor=cfg.mesh.tensor, sequence=cfg.mesh.sequence,
                           num_devices=ndev, platform=platform)
        return pb.ModelInfo(
            model_name=cfg.model_path or cfg.name, architecture=str(getattr(cfg.model, "architecture", "")),
            max_model_len=core.max_model_len, vocab_size=core.vocab_size, page_size=cfg.engine.page_size,
            pages_total=int(stats.get("pages_total", 0)), pages_free=int(stats.get("pages_free", 0)),
            num_running=int(stats.get("num_running", 0)), num_waiting=int(stats.get("num_waiting", 0)),
            max_waiting=core.loop.max_waiting, mesh=mesh)

    async def Tokenize(self, request: pb.TokenizeRequest, context):
        tok = self.core.tokenizer
        add_bos = request.add_bos if request.HasField("add_bos") else True
        if len(request.text) > OFFLOAD_TEXT_CHARS:
            ids = await asyncio.get_running_loop().run_in_executor(None, lambda: tok.encode(request.text, add_bos))
        else:
            ids = tok.encode(request.text, add_bos)
        return pb.TokenizeResponse(token_ids=ids)

    async def Detokenize(self, request: pb.DetokenizeRequest, context):
        vocab = self.core.vocab_size
        bad = [t for t in request.token_ids if not 0 <= t < vocab]
        if bad:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return pb.DetokenizeResponse(text=self.core.tokenizer.decode(list(request.token_ids)))


def _replace(params: SamplingParams, **kw) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, **kw)


class OrchestratorServicer(js_grpc.OrchestratorServicer):
    """JetStream's Orchestrator API: greedy decoding of max_tokens, one Sample per step."""

    def __init__(self, core: _Core):
        self.core = core

    async def Decode(self, request: js.DecodeRequest, context):
        arrival = time.monotonic()
        core = self.core
        await core.check_available(context)
        try:
            which = request.WhichOneof("content")
            if which is None:
                raise BadField("content", "set text_content or token_content")
            if which == "text_content":
                if not request.text_content.text:
                    raise BadField("text_content.text", "is empty")
                ids = await core.encode(request.text_content.text)
                field = "text_content.text"
            else:
                ids = list(request.token_content.token_ids)
                field = "token_content.token_ids"
            core.check_prompt(ids, field)
            if request.num_samples > 1:
                raise BadField("num_samples", f"only 1 sample per request is supported, got {request.num_samples}")
            if request.max_tokens <= 0:
                raise BadField("max_tokens", f"must be >= 1, got {request.max_tokens}")
            params = core.check_params(SamplingParams(max_tokens=request.max_tokens))
        except BadField as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = "js-" + uuid.uuid4().hex
        async with contextlib.aclosing(core.run(context, ids, params, rid, 0, arrival)) as events:
            async for kind, out, _stream, _t in events:
                if kind == "aborted":
                    return
                if out.new_token_ids or out.new_text:
                    sample = js.DecodeResponse.StreamContent.Sample(text=out.new_text, token_ids=out.new_token_ids)
                    yield js.DecodeResponse(stream_content=js.DecodeResponse.StreamContent(samples=[sample]))

    async def HealthCheck(self, request, context):
        return js.HealthCheckResponse(is_live=self.core.loop.state == SERVING)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """`authorization: Bearer <key>` (or the bare key) on every RPC except health checks."""

    def __init__(self, api_key: str):
        self._key = api_key.encode()

    def _ok(self, metadata) -> bool:
        for k, v in metadata or ():
            if k.lower() == "authorization":
                value = v.decode() if isinstance(v, bytes) else v
                if value.lower().startswith("bearer "):
                    value = value[7:]
                return hmac.compare_digest(value.strip().encode(), self._key)
        return False

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(f"/{HEALTH_SERVICE}/") or self._ok(details.invocation_metadata):
            return handler

        async def deny_unary(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key in `authorization`")

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key in `authorization`")
            yield  # pragma: no cover - makes this an async generator

        kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(deny_unary, **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(deny_unary, **kw)
        return grpc.stream_stream_rpc_method_handler(deny_stream, **kw)


class Server:
    """The gRPC server and its EngineLoop. Lives on one asyncio event loop."""

    def __init__(self, engine, host: str = "127.0.0.1", port: int = 0, metrics_port: int | None = None,
                 metrics_host: str | None = None, api_key: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, max_message_bytes: int = 16 << 20, warmup: bool = True):
        self.engine = engine
        self.host, self.port = host, port
        self.metrics_port, self.metrics_host = metrics_port, metrics_host or host
        self.api_key, self.tls = api_key, (tls_cert, tls_key) if tls_cert else None
        self.max_message_bytes = max_message_bytes
        self.warmup = warmup
        self.metrics = ServerMetrics()
        self.loop = EngineLoop(engine, self.metrics)
        self.health = HealthServicer()
        self.core = _Core(engine, self.loop, self.metrics)
        self.server: grpc.aio.Server | None = None
        self.metrics_http = None
        self.ready = asyncio.Event()
        self.started_at = time.monotonic()

    async def start(self) -> int:
        options = [("grpc.max_receive_message_length", self.max_message_bytes),
                   ("grpc.max_send_message_length", self.max_message_bytes),
                   ("grpc.so_reuseport", 0)]
        interceptors = [ApiKeyInterceptor(self.api_key)] if self.api_key else []
        self.server = grpc.aio.server(options=options, interceptors=interceptors)
        pb_grpc.add_GenerationServicer_to_server(GenerationServicer(self.core), self.server)
        js_grpc.add_OrchestratorServicer_to_server(OrchestratorServicer(self.core), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (GENERATION_SERVICE, ORCHESTRATOR_SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME), self.server)
        for name in ("", GENERATION_SERVICE, ORCHESTRATOR_SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{self.host}:{self.port}"
        if self.tls:
            with open(self.tls[0], "rb") as f:
                cert = f.read()
            with open(self.tls[1], "rb") as f:
                key = f.read()
            self.port = self.server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
        else:
            self.port = self.server.add_insecure_port(address)
        if self.metrics_port is not None:
            from prometheus_client import start_http_server

            self.metrics_http, _ = start_http_server(self.metrics_port, addr=self.metrics_host,
                                                     registry=self.metrics.registry)
            self.metrics_port = self.metrics_http.server_port
        await self.server.start()
        aio_loop = asyncio.get_running_loop()
        self.loop.start(aio_loop, warmup=self.warmup, on_ready=lambda: aio_loop.create_task(self._on_ready()))
        return self.port

    async def _on_ready(self) -> None:
        if self.loop.state != SERVING:
            return
        for name in ("", GENERATION_SERVICE, ORCHESTRATOR_SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.ready.set()

    async def wait_ready(self, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self.ready.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def shutdown(self, grace_s: float = 30.0) -> dict:
        """Drain: NOT_SERVING, refuse new work, let in-flight finish within grace_s, abort the rest."""
        self.loop.begin_drain()
        await self.health.enter_graceful_shutdown()
        deadline = time.monotonic() + grace_s
        in_flight = self.loop.num_active
        while self.loop.num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        aborted = self.loop.abort_all()
        flush_deadline = time.monotonic() + 2.0
        while self.loop.num_active and time.monotonic() < flush_deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # let the aborted streams' last messages go out
        await self.server.stop(1.0)
        await asyncio.get_running_loop().run_in_executor(None, self.loop.stop)
        if self.metrics_http is not None:
            self.metrics_http.shutdown()
            self.metrics_http.server_close()
        return {"in_flight": in_flight, "aborted": aborted}


class ServerThread:
    """A Server on its own event loop thread: for tests, notebooks and the in-process benchmark."""

    def __init__(self, engine, **kwargs):
        self._loop = asyncio.new_event_loop()
        self.server = Server(engine, **kwargs)
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="jaxfill-grpc", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error:
            raise self._error

    def _run(self):
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self.server.start())
        except BaseException as e:  # noqa: BLE001
            self._error = e
            self._started.set()
            return
        self._started.set()
        self._loop.run_forever()

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def address(self) -> str:
        return f"{self.server.host}:{self.server.port}"

    def wait_ready(self, timeout: float = 600.0) -> bool:
        return asyncio.run_coroutine_threadsafe(self.server.wait_ready(timeout), self._loop).result(timeout + 5)

    def call(self, fn, *args):
        """Runs fn(*args) on the server's event loop and returns its result."""
        async def wrapped():
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(wrapped(), self._loop).result(30)

    def stop(self, grace_s: float = 5.0) -> dict:
        result = asyncio.run_coroutine_threadsafe(self.server.shutdown(grace_s), self._loop).result(grace_s + 60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        return result
