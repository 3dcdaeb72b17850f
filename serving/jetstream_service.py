"""JetStream's Orchestrator API (jetstream/core/proto/jetstream.proto) over RequestCore:
greedy decoding of max_tokens, one Sample per step.

BOS as JetStream's orchestrator does it (`is_bos = not request.has_bos`, applied to text and
token content alike): text is tokenized without special tokens, and unless the client sets
has_bos the BOS id goes in front, of token ids too.
"""

from __future__ import annotations

import contextlib
import time
import uuid

import grpc

from jaxfill.engine.request import SamplingParams
from jaxfill.serving.engine_loop import SERVING
from jaxfill.serving.request_core import BadField, RequestCore
from jaxfill.serving.proto.jetstream.core.proto import jetstream_pb2 as js
from jaxfill.serving.proto.jetstream.core.proto import jetstream_pb2_grpc as js_grpc


class OrchestratorServicer(js_grpc.OrchestratorServicer):
    def __init__(self, core: RequestCore):
        self.core = core

    async def _prompt(self, request: js.DecodeRequest) -> list[int]:
        core = self.core
        which = request.WhichOneof("content")
        if which is None:
            raise BadField("content", "set text_content or token_content")
        if which == "text_content":
            if not request.text_content.text:
                raise BadField("text_content.text", "is empty")
            ids, field = await core.encode(request.text_content.text, add_bos=False), "text_content.text"
        else:
            if not request.token_content.token_ids:
                raise BadField("token_content.token_ids", "is empty")
            ids, field = list(request.token_content.token_ids), "token_content.token_ids"
        if not request.has_bos and core.bos_token_id is not None:
            ids = [core.bos_token_id] + ids
        core.check_prompt(ids, field)
        return ids

    async def Decode(self, request: js.DecodeRequest, context):
        arrival = time.monotonic()
        core = self.core
        await core.check_available(context)
        try:
            ids = await self._prompt(request)
            if request.num_samples > 1:
                raise BadField("num_samples", f"only 1 sample per request is supported, got {request.num_samples}")
            if request.max_tokens <= 0:
                raise BadField("max_tokens", f"must be >= 1, got {request.max_tokens}")
            if request.lora_adapter_id:  # an adapter the server loaded (serve --lora)
                core.check_lora(request.lora_adapter_id, "lora_adapter_id")
            params = core.check_params(SamplingParams(max_tokens=request.max_tokens,
                                                      lora=request.lora_adapter_id or None), field="")
            core.check_fits(len(ids), params.max_tokens, "max_tokens")
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
