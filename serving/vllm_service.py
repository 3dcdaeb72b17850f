"""vllm.grpc.engine.VllmEngine (stubs from the smg-grpc-proto package) over RequestCore.

What the smg gateway speaks to its workers: it tokenizes (with the HF tokenizer files
GetModelInfo points it at), sends token ids, reads token ids back and detokenizes itself.
Field translation lives in vllm_convert.py; engine behaviour is the engine's.
Embed (serving/vllm_embed.py: the gateway's /v1/embeddings) runs Engine.embed's pooling
through the engine loop. FlushCache and the profiler RPCs are left UNIMPLEMENTED.
Images (a model with a vision tower): media_refs' data: URLs, decoded and expanded as the
Python API does (serving/images.py); GetServerInfo's mm_processor tells smg to send them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from datetime import datetime, timezone
from importlib import resources

import grpc
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from jaxfill.engine.tokenizer import ByteTokenizer
from jaxfill.serving import vllm_convert as conv
from jaxfill.serving import images, vllm_embed
from jaxfill.models.families.registry import family_of
from jaxfill.serving.disagg import Disagg
from jaxfill.serving.fanout import merged, samples_of
from jaxfill.serving.engine_loop import DRAINING, SERVING
from jaxfill.serving.request_core import BadField, RequestCore, served_name

VLLM_SERVICE = vpb.DESCRIPTOR.services_by_name["VllmEngine"].full_name  # vllm.grpc.engine.VllmEngine
SERVER_TYPE = "vllm-grpc"  # the protocol, as GetServerInfoResponse documents the field
# smg gives SubscribeKvEvents 2 s to answer and takes a silent stream for a dead worker:
# a load-only batch goes out at once and whenever the cache has been quiet this long.
KV_HEARTBEAT_S = 0.5
# A model with a vision tower takes images as media_refs (data: URLs; serving/images.py):
# what smg reads to send it the client's images unprocessed instead of its own pixels.
MEDIA_INFO = dict(mm_processor="inprocess", mm_media_ref_schemes="data", mm_processor_source="default")


def tokenizer_dir(config, tokenizer) -> str:
    """A directory holding HF tokenizer files for this model, or "": the checkpoint's
    (`--model DIR` or a preset's checkpoint) when it has a tokenizer.json, else, for the byte
    tokenizer, configs/tiny/ (its tokenizer.json encodes bytes the same way)."""
    if config.model_path and os.path.isfile(os.path.join(config.model_path, "tokenizer.json")):
        return os.path.abspath(config.model_path)
    if isinstance(tokenizer, ByteTokenizer):
        path = str(resources.files("jaxfill.configs").joinpath("tiny"))
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            return path
    return ""


class VllmEngineServicer(vpb_grpc.VllmEngineServicer):
    def __init__(self, core: RequestCore, served_model_name: str | None = None):
        self.core = core
        cfg = core.engine.config
        self.config = cfg
        self.served_model_name = served_model_name or served_name(cfg)
        self.tokenizer_dir = tokenizer_dir(cfg, core.tokenizer)
        self.started_wall = time.time()
        self.last_receive = 0.0
        self.vision = core.engine.factory.vision is not None  # reads images (media_refs)
        # --role prefill|decode|both (serving/disagg.py); serve.py replaces this default
        self.disagg = Disagg(core.engine, core.loop, "both")

    # ------------------------------------------------------------------ Generate
    async def _parse(self, request: vpb.GenerateRequest):
        core = self.core
        rid = core.request_id(request.request_id)
        conv.check_request_fields(request)
        sp = request.sampling_params
        keep = (conv.SP + "truncate_prompt_tokens", sp.truncate_prompt_tokens) \
            if sp.HasField("truncate_prompt_tokens") else None
        text = images.marked(core, request.text, request.HasField("media_refs"))
        ids = await core.prompt(request.WhichOneof("input"), text, request.tokenized.input_ids,
                                "tokenized.input_ids", "tokenized.input_ids or text", keep)
        if request.HasField("media_refs"):  # images as data: URLs, one placeholder each in the ids
            ids = await images.expand(core, ids, conv.media_ref_blobs(request.media_refs), "media_refs.items")
        params = conv.sampling_from_proto(request.sampling_params, core.max_model_len - len(ids), core.vocab_size)
        core.check_params(params, conv.SP)
        core.check_fits(len(ids), params.max_tokens, conv.SP + "max_tokens")
        return rid, ids, params, conv.data_parallel_rank(request, self.config.mesh.data)

    async def Generate(self, request: vpb.GenerateRequest, context):
        arrival = time.monotonic()
        self.last_receive = time.time()
        core = self.core
        try:  # until the pull starts, any refusal releases the prefill worker's KV at once
            await core.check_available(context)
            try:
                rid, ids, params, rank = await self._parse(request)
                kv = self.disagg.parse(request)
            except BadField as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            remote_decode = bool(kv and kv.get("do_remote_decode"))
            if remote_decode:
                await self.disagg.hold(rid, context)
        except BaseException:
            self.disagg.release_offer_of(request)
            raise
        try:
            if kv and kv.get("do_remote_prefill"):
                await self.disagg.pull(rid, ids, kv, context)
            if params.n > 1:
                if kv:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        f"{conv.SP}n: n > 1 is not served with disaggregated prefill")
                gens = [self._generate(request, context, f"{rid}#{i}", ids, sample, arrival, False, index=i,
                                       after=f"{rid}#0" if i else None, replica=rank)
                        for i, sample in enumerate(samples_of(params))]
                async for msg in merged(gens):
                    yield msg
                return
            async for msg in self._generate(request, context, rid, ids, params, arrival, remote_decode,
                                            replica=rank):
                yield msg
        finally:
            self.disagg.forget(rid)

    async def _generate(self, request, context, rid, ids, params, arrival, remote_decode: bool, index: int = 0,
                        after: str | None = None, replica: int | None = None):
        """One sample's messages; index: which of n (the messages' `index`), after: sample 0's id,
        replica: the data replica it is pinned to (data_parallel_rank; a decode worker's pulled
        rows go to that replica's pool)."""
        core = self.core
        output_ids: list[int] = []
        logprobs: list = []
        async with contextlib.aclosing(core.run(context, ids, params, rid, 0, arrival, after, replica)) as events:
            async for kind, out, stream, _t in events:
                if kind == "aborted":
                    complete = self._complete(stream, "abort", output_ids, logprobs, None, params)
                    complete.index = index
                    yield vpb.GenerateResponse(complete=complete)
                    return
                output_ids += out.new_token_ids
                if out.logprobs and params.logprobs is not None:
                    logprobs += out.logprobs
                if request.stream and out.new_token_ids:
                    chunk = vpb.GenerateStreamChunk(
                        token_ids=out.new_token_ids, prompt_tokens=len(ids), completion_tokens=len(output_ids),
                        cached_tokens=stream.cached_tokens, index=index)
                    if params.logprobs is not None:
                        chunk.output_logprobs.CopyFrom(conv.logprobs_to_proto(out.logprobs))
                    if out.prompt_logprobs is not None:  # the first chunk only
                        chunk.input_logprobs.CopyFrom(conv.input_logprobs_to_proto(ids, out.prompt_logprobs))
                    yield vpb.GenerateResponse(chunk=chunk)
                if out.finished:
                    c = out.completion
                    complete = self._complete(stream, c.finish_reason if c else "stop", output_ids, logprobs, c,
                                              params, with_logprobs=not request.stream)
                    if not request.stream and c is not None and c.prompt_logprobs is not None:
                        complete.input_logprobs.CopyFrom(conv.input_logprobs_to_proto(ids, c.prompt_logprobs))
                    complete.index = index
                    if remote_decode:  # what the gateway relays to the decode worker
                        complete.kv_transfer_params_json = self.disagg.offer_json(rid)
                    yield vpb.GenerateResponse(complete=complete)

    def _complete(self, stream, reason: str, output_ids, logprobs, completion, params,
                  with_logprobs: bool = True) -> vpb.GenerateComplete:
        """The final message; a streaming client already got the ids and logprobs in chunks,
        but `output_ids` always carries them all (vLLM's servicer does the same)."""
        msg = vpb.GenerateComplete(
            output_ids=completion.token_ids if completion is not None else output_ids, finish_reason=reason,
            prompt_tokens=stream.prompt_tokens, completion_tokens=len(output_ids),
            cached_tokens=completion.cached_tokens if completion is not None else stream.cached_tokens)
        if with_logprobs and params.logprobs is not None:
            msg.output_logprobs.CopyFrom(conv.logprobs_to_proto(logprobs))
        conv.set_matched_stop(msg, completion, params, self.core.tokenizer)
        return msg

    async def Embed(self, request: vpb.EmbedRequest, context):
        self.last_receive = time.time()
        return await vllm_embed.embed(self.core, request, context)

    async def Abort(self, request: vpb.AbortRequest, context):
        for rid in self.disagg.take_releases(request.request_ids):  # "kvx-release:<id>": a decode side pulled
            self.core.loop.abort(rid, notify=True)
        return vpb.AbortResponse()

    # ------------------------------------------------------------------ status
    async def HealthCheck(self, request, context):
        state = self.core.loop.state
        if state == SERVING:
            return vpb.HealthCheckResponse(healthy=True, message="serving")
        return vpb.HealthCheckResponse(healthy=False, message=f"not serving: {state}")

    async def GetModelInfo(self, request, context):
        m = self.config.model
        tok = self.core.tokenizer
        eos = getattr(tok, "eos_token_ids", None) or m.eos_token_id or ()
        bos = getattr(tok, "bos_token_id", None)
        return vpb.GetModelInfoResponse(
            model_path=self.tokenizer_dir or self.served_model_name, tokenizer_path=self.tokenizer_dir,
            served_model_name=self.served_model_name, is_generation=True, supports_vision=self.vision,
            max_context_length=self.core.max_model_len, max_req_input_len=self.core.max_model_len - 1,
            vocab_size=self.core.vocab_size, model_type=family_of(m.architecture).name,
            architectures=[m.architecture], eos_token_ids=list(eos),
            bos_token_id=-1 if bos is None else bos, pad_token_id=-1)

    async def GetServerInfo(self, request, context):
        cfg = self.config
        return vpb.GetServerInfoResponse(
            active_requests=self.core.loop.num_active, is_paused=self.core.loop.state == DRAINING,
            last_receive_timestamp=self.last_receive, uptime_seconds=time.time() - self.started_wall,
            server_type=SERVER_TYPE, data_parallel_size=cfg.mesh.data, **self.disagg.server_info(),
            **(MEDIA_INFO if self.vision else {}),
            kv_cache_dtype={"float8_e4m3fn": "fp8_e4m3"}.get(cfg.engine.kv_cache_dtype, cfg.engine.kv_cache_dtype),
            block_size=cfg.engine.page_size, model_dtype=str(cfg.model.dtype),
            max_num_seqs=cfg.engine.max_num_seqs * cfg.mesh.data)

    def _load(self) -> dict:
        """The numbers GetLoads and the KV-event load records share."""
        s = self.core.loop.stats()
        page_size = int(s.get("page_size", self.config.engine.page_size))
        total, free = int(s.get("pages_total", 0)), int(s.get("pages_free", 0))
        queries = int(s.get("prefix_cache_queries", 0))
        running, waiting = int(s.get("num_running", 0)), int(s.get("num_waiting", 0))
        waiting += max(self.core.loop.num_active - running - waiting, 0)  # admitted, not yet in the engine
        return dict(running=running, waiting=waiting, used_tokens=(total - free) * page_size,
                    total_tokens=total * page_size, usage=(total - free) / total if total else 0.0,
                    hit_rate=int(s.get("prefix_cache_hits", 0)) / queries if queries else 0.0)

    def _engine_load(self, sample: int, load_only: bool) -> cpb.EngineLoad:
        d = self._load()
        return cpb.EngineLoad(running_requests=d["running"], waiting_requests=d["waiting"], token_usage=d["usage"],
                              max_running_requests=self.core.loop.batch_slots, sample=sample, load_only=load_only)

    async def GetLoads(self, request: vpb.GetLoadsRequest, context):
        d = self._load()
        load = vpb.SchedulerLoad(
            dp_rank=0, num_running_reqs=d["running"], num_waiting_reqs=d["waiting"],
            num_total_reqs=d["running"] + d["waiting"], num_used_tokens=d["used_tokens"],
            max_total_num_tokens=d["total_tokens"], token_usage=d["usage"], cache_hit_rate=d["hit_rate"],
            max_running_requests=self.core.loop.batch_slots)
        return vpb.GetLoadsResponse(timestamp=datetime.now(timezone.utc).isoformat(), version="jaxfill",
                                    dp_rank_count=1, loads=[load])

    async def GetTokenizer(self, request, context):
        if not self.tokenizer_dir:
            await context.abort(grpc.StatusCode.NOT_FOUND, "this model has no HF tokenizer files to send")
        data, digest = conv.tokenizer_zip(self.tokenizer_dir)
        step = conv.TOKENIZER_CHUNK_BYTES
        for i in range(0, len(data), step):
            last = i + step >= len(data)
            yield cpb.GetTokenizerChunk(data=data[i:i + step], sha256=digest if last else "")

    async def SubscribeKvEvents(self, request: cpb.SubscribeKvEventsRequest, context):
        """Event batches as the prefix cache changes, each with the load record; a load-only
        batch (repeating the last sequence sent) at once and as a heartbeat while quiet."""
        loop = self.core.loop
        q = loop.subscribe_kv(request.start_sequence_number)
        page_size = self.config.engine.page_size
        last_seq, sample = 0, 0
        try:
            yield cpb.KvEventBatch(sequence_number=0, timestamp=time.time(), load=self._engine_load(0, True))
            while True:
                try:
                    batch = await asyncio.wait_for(q.get(), KV_HEARTBEAT_S)
                except asyncio.TimeoutError:
                    sample += 1
                    yield cpb.KvEventBatch(sequence_number=last_seq, timestamp=time.time(),
                                           load=self._engine_load(sample, True))
                    continue
                if batch is None:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        "KV event subscriber fell too far behind; resubscribe")
                sample += 1
                msg = conv.kv_batch_to_proto(batch, page_size)
                msg.load.CopyFrom(self._engine_load(sample, False))
                last_seq = msg.sequence_number
                yield msg
        finally:
            loop.unsubscribe_kv(q)

