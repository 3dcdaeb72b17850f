"""gRPC server interceptors: what every RPC of every protocol goes through.

ErrorStatusInterceptor: an exception a servicer did not expect becomes an INTERNAL status
and one log line with its traceback, never grpc's bare UNKNOWN; the server and the other
requests go on. ApiKeyInterceptor: `--api-key`.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging

import grpc
from grpc_health.v1 import health_pb2

log = logging.getLogger("jaxfill.serving")
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


def _replace_behaviour(handler, unary_wrap, stream_wrap):
    """handler with its one behaviour wrapped (a response stream: stream_wrap)."""
    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream_wrap(handler.unary_stream), **kw)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary_wrap(handler.unary_unary), **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary_wrap(handler.stream_unary), **kw)
    return grpc.stream_stream_rpc_method_handler(stream_wrap(handler.stream_stream), **kw)


class ErrorStatusInterceptor(grpc.aio.ServerInterceptor):
    """Aborts (context.abort), cancellation and the client going away pass through as they
    are; anything else is a bug on our side: logged with the method, answered INTERNAL."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method

        async def internal(context, e: BaseException):
            log.exception("%s failed: %s: %s", method, type(e).__name__, e)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(e).__name__}: {e}")

        def unary_wrap(behaviour):
            async def run(request, context):
                try:
                    out = behaviour(request, context)
                    return await out if inspect.isawaitable(out) else out
                except (grpc.aio.AbortError, asyncio.CancelledError):
                    raise
                except Exception as e:  # noqa: BLE001 - answered INTERNAL, logged
                    await internal(context, e)
            return run

        def stream_wrap(behaviour):
            async def run(request, context):
                try:
                    out = behaviour(request, context)
                    if inspect.isasyncgen(out):
                        async for msg in out:
                            yield msg
                    else:
                        for msg in out:
                            yield msg
                except (grpc.aio.AbortError, asyncio.CancelledError, GeneratorExit):
                    raise
                except Exception as e:  # noqa: BLE001 - answered INTERNAL, logged
                    await internal(context, e)
            return run

        return _replace_behaviour(handler, unary_wrap, stream_wrap)


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

        return _replace_behaviour(handler, lambda _: deny_unary, lambda _: deny_stream)
