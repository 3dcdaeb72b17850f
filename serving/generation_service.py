"""jaxfill.v1.Generation (serving/proto/jaxfill/v1/generation.proto) over RequestCore."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import grpc

from jaxfill.engine.request import InvalidRequest, SamplingParams
from jaxfill.serving import images
from jaxfill.serving.request_core import BadField, RequestCore, served_name, structured_from_proto
from jaxfill.serving.proto.jaxfill.v1 import generation_pb2 as pb
from jaxfill.serving.proto.jaxfill.v1 import generation_pb2_grpc as pb_grpc

MAX_CACHE_SALT_LEN = 1024
DEFAULT_MAX_TOKENS = 16  # when sampling.max_tokens is unset (and the prompt leaves room for it)


def sampling_from_proto(s: pb.SamplingParams, room: int) -> SamplingParams:
    """room: tokens left after the prompt, the bound of an unset max_tokens."""
    return SamplingParams(
        max_tokens=s.max_tokens if s.max_tokens != 0 else min(DEFAULT_MAX_TOKENS, room),
        temperature=s.temperature, top_k=s.top_k,
        top_p=s.top_p if s.HasField("top_p") else 1.0, min_p=s.min_p,
        seed=s.seed if s.HasField("seed") else None, stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        logprobs=s.logprobs if s.HasField("logprobs") else None, min_tokens=s.min_tokens,
        logit_bias=dict(s.logit_bias),
        truncate_prompt_tokens=s.truncate_prompt_tokens if s.HasField("truncate_prompt_tokens") else None,
        structured_output=structured_from_proto(s),
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None)


def logprobs_to_proto(entries) -> list[pb.TokenLogprob]:
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


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, core: RequestCore, served_model_name: str | None = None):
        self.core = core
        self.served_model_name = served_model_name or served_name(core.engine.config)

    async def _parse(self, request: pb.GenerateRequest) -> tuple[str, list[int], SamplingParams]:
        core = self.core
        rid = core.request_id(request.request_id)
        s = request.sampling
        keep = ("sampling.truncate_prompt_tokens", s.truncate_prompt_tokens) \
            if s.HasField("truncate_prompt_tokens") else None
        text = images.marked(core, request.text, bool(request.images))
        ids = await core.prompt(request.WhichOneof("input"), text, request.token_ids.ids,
                                "token_ids.ids", "text or token_ids", keep)
        if request.images:  # encoded files, one placeholder each in the prompt (serving/images.py)
            ids = await images.expand(core, ids, list(request.images), "images")
        params = sampling_from_proto(request.sampling, core.max_model_len - len(ids))
        if len(request.cache_salt) > MAX_CACHE_SALT_LEN:
            raise BadField("cache_salt", f"longer than {MAX_CACHE_SALT_LEN} characters")
        if request.cache_salt:
            params = dataclasses.replace(params, cache_salt=request.cache_salt)
        if request.lora:  # an adapter the server loaded (serve --lora)
            core.check_lora(request.lora, "lora")
            params = dataclasses.replace(params, lora=request.lora)
        core.check_params(params)
        core.check_fits(len(ids), params.max_tokens, "sampling.max_tokens")
        return rid, ids, params

    async def Generate(self, request: pb.GenerateRequest, context):
        arrival = time.monotonic()
        core = self.core
        await core.check_available(context)
        try:
            rid, ids, params = await self._parse(request)
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
                        chunk.logprobs.extend(logprobs_to_proto(out.logprobs))
                    if out.prompt_logprobs is not None:
                        chunk.prompt_logprobs.extend(logprobs_to_proto(out.prompt_logprobs[1:]))
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
            model_name=self.served_model_name, architecture=str(getattr(cfg.model, "architecture", "")),
            max_model_len=core.max_model_len, vocab_size=core.vocab_size, page_size=cfg.engine.page_size,
            pages_total=int(stats.get("pages_total", 0)), pages_free=int(stats.get("pages_free", 0)),
            num_running=int(stats.get("num_running", 0)), num_waiting=int(stats.get("num_waiting", 0)),
            max_waiting=core.loop.max_waiting, mesh=mesh, kv_cache_dtype=cfg.engine.kv_cache_dtype,
            kv_bytes_per_token=int(stats.get("kv_bytes_per_token", 0)), weight_dtype=cfg.model.weight_dtype,
            weight_bytes=int(stats.get("weight_bytes", 0)))

    async def Tokenize(self, request: pb.TokenizeRequest, context):
        add_bos = request.add_bos if request.HasField("add_bos") else True
        return pb.TokenizeResponse(token_ids=await self.core.encode(request.text, add_bos))

    # ------------------------------------------------------------------ LoRA adapters (engine/lora/)
    async def LoadLora(self, request: pb.LoadLoraRequest, context):
        return await self._lora(context, "load_lora", request.name, request.path)

    async def UnloadLora(self, request: pb.UnloadLoraRequest, context):
        return await self._lora(context, "unload_lora", request.name)

    async def ListLoras(self, request: pb.ListLorasRequest, context):
        return await self._lora(context, "list_loras")

    async def _lora(self, context, call: str, *args):
        """Engine.load_lora / unload_lora / list_loras off the event loop (a load reads the
        adapter from disk); refusals are INVALID_ARGUMENT naming the field, an unknown name
        to unload NOT_FOUND."""
        from jaxfill.engine.lora.adapter import AdapterError

        engine = self.core.engine
        try:
            if call != "list_loras" and not args[0]:
                raise InvalidRequest("name", "must be a non-empty adapter name")
            found = await asyncio.to_thread(getattr(engine, call), *args)
            adapters = await asyncio.to_thread(engine.list_loras)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except AdapterError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"path: {e}")
        if found is False:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"name: no adapter {args[0]!r} is loaded")
        return pb.LoraAdapters(adapters=[pb.LoraAdapter(name=a["name"], path=a["path"], slot=a["slot"])
                                         for a in adapters])

    async def Detokenize(self, request: pb.DetokenizeRequest, context):
        vocab = self.core.vocab_size
        bad = [t for t in request.token_ids if not 0 <= t < vocab]
        if bad:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return pb.DetokenizeResponse(text=self.core.tokenizer.decode(list(request.token_ids)))
