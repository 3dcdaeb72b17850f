"""gRPC server: jaxfill.v1.Generation, the JetStream Orchestrator shim, vLLM's
vllm.grpc.engine.VllmEngine (what the smg gateway routes to), jaxfill.v1.EngineAdmin
(weight updates, sleep and wake: serving/admin_service.py), health, reflection.

One adapter module per protocol (generation_service.py, jetstream_service.py,
vllm_service.py) over one
validation layer (request_core.py) and one engine loop (engine_loop.py). Everything here
runs on one asyncio event loop (grpc.aio); the Engine runs on the EngineLoop's thread.
Status codes:
    INVALID_ARGUMENT    bad input, or prompt plus max_tokens over max_model_len; the
                        message starts with the offending field's name
    RESOURCE_EXHAUSTED  every batch slot and engine.max_waiting waiting places are taken
    UNAVAILABLE         warming up (health NOT_SERVING), draining, warm-up failed, or the
                        engine sleeps (EngineAdmin.Sleep until EngineAdmin.WakeUp)
    UNAUTHENTICATED     --api-key set and `authorization` metadata missing or wrong
    INTERNAL            this request's step failed; the server and other requests go on
A stream whose client cancels, disconnects or passes its deadline is aborted in the
engine before the next step (its pages freed at once).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from jaxfill.serving.engine_loop import SERVING, EngineLoop
from jaxfill.serving.interceptors import HEALTH_SERVICE, ApiKeyInterceptor, ErrorStatusInterceptor
from jaxfill.serving.admin_service import ADMIN_SERVICE, EngineAdminServicer
from jaxfill.serving.generation_service import GenerationServicer
from jaxfill.serving.jetstream_service import OrchestratorServicer
from jaxfill.serving.metrics import ServerMetrics
from jaxfill.serving.proto.jaxfill.v1 import engine_admin_pb2_grpc as admin_grpc
from jaxfill.serving.proto.jaxfill.v1 import generation_pb2 as pb
from jaxfill.serving.proto.jaxfill.v1 import generation_pb2_grpc as pb_grpc
from jaxfill.serving.proto.jetstream.core.proto import jetstream_pb2 as js
from jaxfill.serving.proto.jetstream.core.proto import jetstream_pb2_grpc as js_grpc
from jaxfill.serving.request_core import RequestCore, served_name
from jaxfill.serving.vllm_service import VLLM_SERVICE, VllmEngineServicer

log = logging.getLogger("jaxfill.serving")

GENERATION_SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # jaxfill.v1.Generation
ORCHESTRATOR_SERVICE = js.DESCRIPTOR.services_by_name["Orchestrator"].full_name  # jetstream_proto.Orchestrator


class Server:
    """The gRPC server and its EngineLoop. Lives on one asyncio event loop."""

    def __init__(self, engine, host: str = "127.0.0.1", port: int = 0, metrics_port: int | None = None,
                 metrics_host: str | None = None, api_key: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, max_message_bytes: int = 16 << 20, warmup: bool = True,
                 served_model_name: str | None = None):
        self.engine = engine
        self.host, self.port = host, port
        self.metrics_port, self.metrics_host = metrics_port, metrics_host or host
        self.api_key, self.tls = api_key, (tls_cert, tls_key) if tls_cert else None
        self.max_message_bytes = max_message_bytes
        self.warmup = warmup
        cfg = engine.config
        # One name in every protocol, metrics label and log line (--served-model-name, else
        # the model directory's basename, else the config name).
        self.served_model_name = served_model_name or served_name(cfg)
        self.metrics = ServerMetrics(model_name=self.served_model_name, max_model_len=cfg.engine.max_model_len)
        self.loop = EngineLoop(engine, self.metrics)
        self.health = HealthServicer()
        self.core = RequestCore(engine, self.loop)
        self.vllm = VllmEngineServicer(self.core, self.served_model_name)
        self.server: grpc.aio.Server | None = None
        self.metrics_http = None
        self.ready = asyncio.Event()
        self.started_at = time.monotonic()

    async def start(self) -> int:
        options = [("grpc.max_receive_message_length", self.max_message_bytes),
                   ("grpc.max_send_message_length", self.max_message_bytes),
                   ("grpc.so_reuseport", 0)]
        interceptors = [ErrorStatusInterceptor()] + ([ApiKeyInterceptor(self.api_key)] if self.api_key else [])
        self.server = grpc.aio.server(options=options, interceptors=interceptors)
        pb_grpc.add_GenerationServicer_to_server(GenerationServicer(self.core, self.served_model_name), self.server)
        js_grpc.add_OrchestratorServicer_to_server(OrchestratorServicer(self.core), self.server)
        vllm_grpc.add_VllmEngineServicer_to_server(self.vllm, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        admin_grpc.add_EngineAdminServicer_to_server(EngineAdminServicer(self.engine, self.loop), self.server)
        reflection.enable_server_reflection(
            (GENERATION_SERVICE, ORCHESTRATOR_SERVICE, VLLM_SERVICE, HEALTH_SERVICE, ADMIN_SERVICE,
             reflection.SERVICE_NAME),
            self.server)
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
    """A Server on its own event loop thread: for tests, notebooks and the in-process benchmark.

        with ServerThread(engine, port=0) as st:
            st.wait_ready()
            ...  # st.address
    Leaving the block (or stop()) drains the server, stops the engine thread and closes the loop.
    """

    def __init__(self, engine, **kwargs):
        self.event_loop = asyncio.new_event_loop()
        self.server = Server(engine, **kwargs)
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._stopped: dict | None = None
        self.thread = threading.Thread(target=self._run, name="jaxfill-grpc", daemon=True)
        self.thread.start()
        self._started.wait()
        if self._error:
            self.thread.join(10)
            self.event_loop.close()
            raise self._error

    def __enter__(self) -> "ServerThread":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self):
        asyncio.set_event_loop(self.event_loop)
        try:
            self.event_loop.run_until_complete(self.server.start())
        except BaseException as e:  # noqa: BLE001
            self._error = e
            self._started.set()
            return
        self._started.set()
        self.event_loop.run_forever()

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def address(self) -> str:
        return f"{self.server.host}:{self.server.port}"

    def wait_ready(self, timeout: float = 600.0) -> bool:
        return asyncio.run_coroutine_threadsafe(self.server.wait_ready(timeout), self.event_loop).result(timeout + 5)

    def call(self, fn, *args):
        """Runs fn(*args) on the server's event loop and returns its result."""
        async def wrapped():
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(wrapped(), self.event_loop).result(30)

    def stop(self, grace_s: float = 5.0) -> dict:
        """Drains (see Server.shutdown), then stops and closes the event loop. Idempotent."""
        if self._stopped is None:
            self._stopped = asyncio.run_coroutine_threadsafe(self.server.shutdown(grace_s),
                                                             self.event_loop).result(grace_s + 60)
            self.event_loop.call_soon_threadsafe(self.event_loop.stop)
            self.thread.join(10)
            if not self.thread.is_alive():
                self.event_loop.close()
        return self._stopped
