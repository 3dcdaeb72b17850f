"""jaxfill.v1.EngineAdmin (serving/proto/jaxfill/v1/engine_admin.proto): weight updates,
sleep and wake of a serving engine.

Each call runs on the EngineLoop's thread between two steps (EngineLoop.call_on_engine),
so it never races a step; the handler awaits its result. UpdateWeights with requests in
flight lets them finish on the old weights first (their outputs reach their streams at
the next step) unless abort_in_flight. While the engine sleeps, generate calls of every
protocol get UNAVAILABLE (RequestCore.check_available) and the server keeps running.
The server's --api-key, when set, guards these calls like every other.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

import grpc

from jaxfill.engine.sleep import EngineAsleep
from jaxfill.engine.weights_update import WeightUpdateError
from jaxfill.serving.proto.jaxfill.v1 import engine_admin_pb2 as pb
from jaxfill.serving.proto.jaxfill.v1 import engine_admin_pb2_grpc as pb_grpc

ADMIN_SERVICE = pb.DESCRIPTOR.services_by_name["EngineAdmin"].full_name


class EngineAdminServicer(pb_grpc.EngineAdminServicer):
    def __init__(self, engine, loop_):
        self.engine = engine
        self.loop = loop_  # the EngineLoop

    async def _on_engine(self, context, fn):
        """fn() on the engine thread; its refusals as status codes."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def call():
            try:
                done.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the handler
                done.set_exception(e)

        self.loop.call_on_engine(call)
        try:
            return await asyncio.wrap_future(done)
        except (WeightUpdateError, ValueError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineAsleep as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except RuntimeError as e:  # requests in flight (Sleep), a multi-process engine
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))

    async def UpdateWeights(self, request, context):
        if not request.path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "path: a checkpoint directory on the server")
        mode = "abort" if request.abort_in_flight else "finish"
        out = await self._on_engine(context, lambda: self.engine.update_weights(request.path, in_flight=mode))
        return pb.UpdateWeightsResponse(params_replaced=out["params_replaced"], freed_bytes=out["freed_bytes"],
                                        seconds=out["seconds"])

    async def Sleep(self, request, context):
        level = request.level or 1
        out = await self._on_engine(context, lambda: self.engine.sleep(level, discard=request.discard))
        return pb.SleepResponse(freed_bytes=out["freed_bytes"])

    async def WakeUp(self, request, context):
        out = await self._on_engine(context, self.engine.wake)
        return pb.WakeUpResponse(placed_bytes=out["placed_bytes"])

    async def IsSleeping(self, request, context):
        def read():
            from jaxfill.engine.sleep import engine_device_bytes

            return self.engine.sleeping, engine_device_bytes(self.engine.runner, self.engine.sleeping)

        level, nbytes = await self._on_engine(context, read)
        return pb.IsSleepingResponse(sleeping=bool(level), level=level, device_bytes=nbytes)
