"""The one validation layer and stream plumbing every protocol adapter shares.

Adapters (generation_service.py, jetstream_service.py) turn their messages into token
ids and SamplingParams through `RequestCore`, which refuses bad input before anything is
queued (INVALID_ARGUMENT, the message starting with the offending field's path), submits
to the EngineLoop and maps how the request ends onto gRPC status codes.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc

from jaxfill.engine.loading import validate_prompt
from jaxfill.engine.request import InvalidRequest, QueueFull, SamplingParams, StructuredOutput
from jaxfill.engine.sleep import EngineAsleep
from jaxfill.serving.engine_loop import DRAINING, FAILED, SERVING, STOPPED, WARMING, EngineLoop
from jaxfill.serving.proto.jaxfill.v1 import generation_pb2 as pb

MAX_STOP_STRINGS = 16
MAX_REQUEST_ID_LEN = 256
# The client's deadline runs out a network hop before ours (grpc-timeout is counted from
# when each side saw the call), so a cancel this close to our deadline is the deadline.
DEADLINE_SLACK_S = 0.25
OFFLOAD_TEXT_CHARS = 4096  # tokenize longer texts off the event loop



def structured_from_proto(s) -> StructuredOutput | None:
    """A sampling message's `constraint` oneof (jaxfill.v1 and vLLM's protocol spell it alike)."""
    kind = s.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_object":
        return StructuredOutput("json_object") if s.json_object else None
    if kind == "choice":
        return StructuredOutput("choice", tuple(s.choice.choices))
    return StructuredOutput(kind, getattr(s, kind))


def served_name(config) -> str:
    """The default --served-model-name: the model directory's basename, else the config
    name. The one name every protocol, metrics label and log line uses."""
    import os

    return os.path.basename(os.path.normpath(config.model_path)) if config.model_path else config.name

def asleep_message(level: int) -> str:
    return (f"the engine sleeps (level {level}, an EngineAdmin.Sleep call) and serves nothing until "
            "EngineAdmin.WakeUp")


class BadField(Exception):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def why_gone(context) -> str:
    """Why a handler stopped before its request ended: its deadline passed, or the client
    cancelled / disconnected (the metrics' finished_reason)."""
    try:
        remaining = context.time_remaining()
    except Exception:  # noqa: BLE001 - a context without deadlines
        remaining = None
    return "deadline" if remaining is not None and remaining < DEADLINE_SLACK_S else "cancelled"


class RequestCore:
    def __init__(self, engine, loop_: EngineLoop):
        self.engine = engine
        self.loop = loop_
        cfg = engine.config
        self.vocab_size = int(cfg.model.vocab_size)
        self.max_model_len = int(cfg.engine.max_model_len)
        self.tokenizer = engine.tokenizer
        self.bos_token_id = getattr(self.tokenizer, "bos_token_id", None)

    async def check_available(self, context) -> None:
        state = self.loop.state
        if state == SERVING and self.engine.sleeping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, asleep_message(self.engine.sleeping))
        if state == SERVING:
            return
        why = {WARMING: "the server is warming up (compiling shape buckets); retry shortly",
               DRAINING: "the server is draining and refuses new requests",
               STOPPED: "the server is stopped",
               FAILED: f"warm-up failed: {self.loop.error}"}[state]
        await context.abort(grpc.StatusCode.UNAVAILABLE, why)

    async def encode(self, text: str, add_bos: bool = True) -> list[int]:
        if len(text) > OFFLOAD_TEXT_CHARS:
            return await asyncio.get_running_loop().run_in_executor(None, self.tokenizer.encode, text, add_bos)
        return self.tokenizer.encode(text, add_bos)

    @staticmethod
    def request_id(rid: str) -> str:
        """The client's id, or a fresh one when it sent none."""
        if len(rid) > MAX_REQUEST_ID_LEN:
            raise BadField("request_id", f"longer than {MAX_REQUEST_ID_LEN} characters")
        return rid or uuid.uuid4().hex

    async def prompt(self, which: str | None, text: str, ids, ids_field: str, choices: str,
                     keep_last: tuple[str, int] | None = None) -> list[int]:
        """The prompt of a message whose `input` oneof is text or token ids, validated.
        which: the oneof's set field (None: neither); choices: how the message names them;
        keep_last: (field, N) of a truncate_prompt_tokens the caller set: the last N only."""
        if which is None:
            raise BadField("input", f"set either {choices}")
        if which == "text":
            if not text:
                raise BadField("text", "is empty")
            ids, ids_field = await self.encode(text), "text"
        ids = list(ids)
        if keep_last is not None:
            field, n = keep_last
            if n < 1:
                raise BadField(field, f"must be >= 1 (the prompt tokens to keep), got {n}")
            ids = ids[-n:]
        self.check_prompt(ids, ids_field)
        return ids

    def check_prompt(self, ids: list[int], field: str) -> None:
        try:
            validate_prompt(ids, self.vocab_size, self.max_model_len)
        except InvalidRequest as e:
            raise BadField(field, str(e).split(": ", 1)[-1]) from None

    def check_lora(self, name: str, field: str) -> None:
        """A LoRA adapter the server has loaded (serve --lora), or BadField naming `field`."""
        lora = self.engine.core.lora
        if lora is None:
            raise BadField(field, "LoRA adapters are not served here (start with --set lora.max_loras=N --lora NAME=PATH)")
        if not lora.known(name):
            raise BadField(field, f"unknown adapter {name!r}; loaded: {', '.join(lora.names_loaded()) or 'none'}")

    def check_params(self, params: SamplingParams, field: str = "sampling.") -> SamplingParams:
        """field: where the sampling fields sit in the message ("sampling." or "" for JetStream)."""
        try:
            params.validate(self.vocab_size)
            if params.structured_output is not None:  # compiles the grammar: malformed is refused here
                self.engine.factory.grammars.check(params.structured_output, self.engine.tokenizer)
        except InvalidRequest as e:
            # structured_output.<kind> is the message's <kind> field (the constraint oneof)
            name = e.field.removeprefix("structured_output.")
            raise BadField(f"{field}{name}", str(e).split(": ", 1)[-1]) from None
        if params.max_tokens > self.max_model_len:
            raise BadField(f"{field}max_tokens",
                           f"{params.max_tokens} exceeds max_model_len ({self.max_model_len})")
        if len(params.stop) > MAX_STOP_STRINGS:
            raise BadField(f"{field}stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(params.stop)}")
        return params

    def check_fits(self, num_prompt: int, max_tokens: int, field: str) -> None:
        """A request whose prompt plus max_tokens exceeds max_model_len is refused, not cut short."""
        if num_prompt + max_tokens > self.max_model_len:
            raise BadField(field, f"the prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) is "
                                  f"{num_prompt + max_tokens} tokens, over max_model_len ({self.max_model_len})")

    async def run(self, context, ids: list[int], params: SamplingParams, request_id: str, priority: int,
                  arrival: float, after: str | None = None, replica: int | None = None):
        """Submits and yields (kind, payload, stream, t) until the request ends; maps failures
        to status codes. A handler that stops early (cancel, disconnect, deadline) aborts it.
        after: a sibling sample's id, whose prompt pages this one shares (n > 1); replica:
        the data replica it is pinned to (data_parallel_rank), None: placed by the engine."""
        try:
            stream = self.loop.submit(ids, params, request_id, priority, arrival, after, replica)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFull as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        try:
            while True:
                kind, payload, t = await stream.queue.get()
                if kind == "error":
                    if isinstance(payload, EngineAsleep):  # it slept between check_available and admission
                        await context.abort(grpc.StatusCode.UNAVAILABLE, asleep_message(self.engine.sleeping or 1))
                    if isinstance(payload, InvalidRequest):
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(payload))
                    await context.abort(grpc.StatusCode.INTERNAL, str(payload))
                if kind == "aborted":
                    yield kind, None, stream, t
                    return
                yield kind, payload, stream, t
                if payload.finished:
                    c = payload.completion
                    if c is not None and c.finish_reason == "error":
                        await context.abort(grpc.StatusCode.INTERNAL,
                                            c.error or "the engine step for this request failed")
                    return
        finally:
            if not stream.done:  # cancelled, disconnected, deadline passed: free its pages now
                self.loop.abort(request_id, reason=why_gone(context))

    @staticmethod
    def complete(stream, reason: str, completion) -> pb.GenerateComplete:
        m = completion.metrics if completion is not None else {}
        return pb.GenerateComplete(
            request_id=stream.request_id, finish_reason=reason,
            prompt_tokens=completion.prompt_tokens if completion else stream.prompt_tokens,
            completion_tokens=len(completion.token_ids) if completion else stream.num_tokens,
            cached_tokens=completion.cached_tokens if completion else 0,
            queue_time_s=float(m.get("queue_s", 0.0) or 0.0),
            ttft_s=(stream.first_token_t - stream.arrival) if stream.first_token_t is not None else 0.0,
            e2e_s=time.monotonic() - stream.arrival)
