"""vllm.grpc.engine.VllmEngine/Embed over the engine loop: the smg gateway's /v1/embeddings.

The gateway tokenizes and sends ids (EmbedRequest.tokenized); we answer one pooled vector
(Engine.embed's: model.pooling, model.normalize_embeddings). The engine is single-threaded,
so the vector is made by the engine thread like a Generate: `EngineLoop.submit_pooling`
queues it, the thread adds it to the next step (it rides the same ragged prefill as
generation) and its finished output comes back on the stream. Nothing here touches the engine.

Refusals before anything is queued: no pooling configured -> FAILED_PRECONDITION naming
`model.pooling`; an empty, over-long or out-of-vocabulary input -> INVALID_ARGUMENT naming
`tokenized.input_ids`. A handler that stops early (cancel, deadline) aborts the request,
so its pages go back; a failed step answers INTERNAL and the loop has freed them already.
"""

from __future__ import annotations

import logging
import time

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from jaxfill.engine.pooling.api import pooling_params
from jaxfill.engine.request import InvalidRequest, QueueFull
from jaxfill.serving.request_core import BadField, RequestCore, why_gone

log = logging.getLogger("jaxfill.serving")
IDS_FIELD = "tokenized.input_ids"


def embed_params(core: RequestCore):
    """The model's PoolingParams, or InvalidRequest saying model.pooling is not set up."""
    return pooling_params(core.engine, None, None)


def check_input(core: RequestCore, request: vpb.EmbedRequest) -> list[int]:
    """The request's token ids, refused (BadField) when empty, too long or out of vocabulary,
    or when they need more KV pages than the pool holds."""
    if not request.HasField("tokenized") or not request.tokenized.input_ids:
        raise BadField(IDS_FIELD, "is empty: send at least one token id")
    ids = list(request.tokenized.input_ids)
    if len(ids) >= core.max_model_len:  # validate_prompt's limit, said in this message's terms
        raise BadField(IDS_FIELD, f"{len(ids)} tokens; an input must be shorter than max_model_len "
                                  f"({core.max_model_len})")
    core.check_prompt(ids, IDS_FIELD)
    return ids


async def embed(core: RequestCore, request: vpb.EmbedRequest, context) -> vpb.EmbedResponse:
    arrival = time.monotonic()
    await core.check_available(context)
    try:
        params = embed_params(core)
    except InvalidRequest as e:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"Embed: {e}")
    try:
        rid = core.request_id(request.request_id)
        ids = check_input(core, request)
    except BadField as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    try:
        stream = core.loop.submit_pooling(ids, params, rid, arrival)
    except InvalidRequest as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    except QueueFull as e:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
    try:
        vector = await _vector(stream, context)
    finally:
        if not stream.done:  # cancelled, disconnected, deadline passed: free its pages now
            core.loop.abort(rid, reason=why_gone(context))
    return vpb.EmbedResponse(embedding=vector.tolist(), prompt_tokens=len(ids), embedding_dim=int(vector.shape[0]))


async def _vector(stream, context):  # -> [hidden] f32
    """The stream's one finished output's vector; any other ending is a status."""
    while True:
        kind, payload, _t = await stream.queue.get()
        if kind == "error":
            if isinstance(payload, InvalidRequest):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(payload))
            log.error("Embed %s failed: %s", stream.request_id, payload)
            await context.abort(grpc.StatusCode.INTERNAL, f"Embed failed: {payload}")
        if kind == "aborted":
            await context.abort(grpc.StatusCode.ABORTED, f"Embed {stream.request_id} was aborted")
        if payload.finished:
            c = payload.completion
            if c is None or c.embedding is None:
                why = f"{c.finish_reason}: {c.error}" if c is not None else "no completion"
                log.error("Embed %s ended without a vector (%s)", stream.request_id, why)
                await context.abort(grpc.StatusCode.INTERNAL, f"Embed ended without a vector ({why})")
            return c.embedding
