"""What a caller asks for and what it gets back. Plain data; no JAX here."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any


class InvalidRequest(ValueError):
    """Bad input from a caller. `field` names the offending field for API error messages."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class QueueFull(RuntimeError):
    """The waiting queue is at `engine.max_waiting`; the caller should back off."""


MAX_TOP_K = 1 << 20
MAX_SAMPLES = 64  # SamplingParams.n
MAX_LOGPROBS_PER_TOKEN = 20  # top-N logprobs the sampler returns (engine/sampler.py MAX_LOGPROBS)
MAX_LOGIT_BIAS = 300  # entries of SamplingParams.logit_bias (OpenAI's limit)
MAX_MIN_TOKENS_BANS = 64  # EOS + stop token ids masked while min_tokens is not reached
LOGIT_BIAS_SLOTS = MAX_LOGIT_BIAS + MAX_MIN_TOKENS_BANS  # the sampler's per-row bias table


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output (engine/structured_output.py). spec: the JSON schema (text
    or a dict), the regex, the Lark or GBNF grammar, the choices (strings); none for
    json_object (any JSON object)."""

    kind: str
    spec: Any = None

    def __post_init__(self):
        if self.kind == "json_schema" and isinstance(self.spec, dict):
            object.__setattr__(self, "spec", json.dumps(self.spec))
        if self.kind == "choice" and isinstance(self.spec, (list, tuple)):
            object.__setattr__(self, "spec", tuple(self.spec))

    def validate(self) -> None:
        field = f"structured_output.{self.kind}"
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequest("structured_output", f"kind must be one of {', '.join(STRUCTURED_KINDS)}, "
                                                      f"got {self.kind!r}")
        if self.kind == "choice":
            if not isinstance(self.spec, tuple) or not self.spec or not all(
                    isinstance(c, str) and c for c in self.spec):
                raise InvalidRequest(field, "must be a non-empty list of non-empty strings")
        elif self.kind != "json_object" and (not isinstance(self.spec, str) or not self.spec.strip()):
            raise InvalidRequest(field, "must be a non-empty string")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    # samples of the prompt: one prefill, its full pages shared (engine/request_factory.py);
    # sample i draws with seed + i
    n: int = 1
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # same seed, same draws whatever the batch, given the same logits (engine/sampler.py)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None = off; N = chosen token's logprob + top-N
    cache_salt: str | None = None  # requests with different salts never share cached pages
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are out
    # token id -> bias added to its logit before sampling (a dict, or (id, bias) pairs);
    # logprobs stay those of the raw model distribution
    logit_bias: tuple[tuple[int, float], ...] = ()
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last N tokens (None = all)
    structured_output: StructuredOutput | None = None  # the output must match this constraint
    # None = off; k = each prompt token's logprob given the tokens before it, plus the top-k
    prompt_logprobs: int | None = None
    # the LoRA adapter (a name Engine.load_lora gave, or a (name, path) pair loaded on first
    # use); None = the base model (engine/lora/)
    lora: str | tuple[str, str] | None = None

    def __post_init__(self):
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if isinstance(self.lora, list):
            object.__setattr__(self, "lora", tuple(self.lora))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        except (TypeError, ValueError):
            raise InvalidRequest("logit_bias", "must map token ids to numbers") from None

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        def bad(field, msg):
            raise InvalidRequest(field, msg)

        def finite(field, value):
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                bad(field, f"must be a finite number, got {value!r}")

        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_SAMPLES:
            bad("n", f"must be an integer in [1, {MAX_SAMPLES}], got {self.n!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        for field in ("temperature", "top_p", "min_p", "repetition_penalty",
                      "presence_penalty", "frequency_penalty"):
            finite(field, getattr(self, field))
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= MAX_TOP_K:
            bad("top_k", f"must be an integer in [0, {MAX_TOP_K}] (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        for field in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, field) <= 2.0:
                bad(field, f"must be in [-2, 2], got {getattr(self, field)}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            bad("seed", f"must be a non-negative integer, got {self.seed!r}")
        if self.logprobs == -1 and (vocab_size is None or vocab_size > MAX_LOGPROBS_PER_TOKEN):
            bad("logprobs", f"-1 (every token) needs a vocabulary of at most {MAX_LOGPROBS_PER_TOKEN} tokens, "
                            f"the most the sampler returns; this model has {vocab_size}: ask for 0 to "
                            f"{MAX_LOGPROBS_PER_TOKEN}")
        if self.logprobs is not None and self.logprobs != -1 and (
                not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS_PER_TOKEN):
            bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS_PER_TOKEN}] (or -1: all), got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
                not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= 20):
            bad("prompt_logprobs", f"must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        if any(not s for s in self.stop):
            bad("stop", "stop strings must be non-empty")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be an integer in [0, max_tokens = {self.max_tokens}], got {self.min_tokens!r}")
        if self.min_tokens and len(self.stop_token_ids) > MAX_MIN_TOKENS_BANS - 8:
            bad("stop_token_ids", f"at most {MAX_MIN_TOKENS_BANS - 8} with min_tokens, got {len(self.stop_token_ids)}")
        if self.truncate_prompt_tokens is not None and (
                not isinstance(self.truncate_prompt_tokens, int) or self.truncate_prompt_tokens < 1):
            bad("truncate_prompt_tokens", f"must be an integer >= 1 (or unset), got {self.truncate_prompt_tokens!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            bad("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for t, b in self.logit_bias:
            if not math.isfinite(b) or not -100.0 <= b <= 100.0:
                bad("logit_bias", f"the bias of token {t} must be in [-100, 100], got {b}")
        if self.lora is not None and not (isinstance(self.lora, str) and self.lora) and not (
                isinstance(self.lora, tuple) and len(self.lora) == 2 and all(isinstance(x, str) and x for x in self.lora)):
            bad("lora", f"must be an adapter name or a (name, path) pair of non-empty strings, got {self.lora!r}")
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutput):
                bad("structured_output", "must be a StructuredOutput")
            self.structured_output.validate()
        if vocab_size is not None:
            for field, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", [t for t, _ in self.logit_bias])):
                for t in ids:
                    if not 0 <= t < vocab_size:
                        bad(field, f"token id {t} is outside the vocabulary [0, {vocab_size})")
        return self


POOLING_MODES = ("last", "mean", "cls")


@dataclasses.dataclass(frozen=True)
class PoolingParams:
    """A request that is prefilled, never decoded: its final-norm hidden states pooled
    (engine/pooling/). mode: "last" token, "mean" over the prompt, "cls" (first token)."""

    mode: str = "last"
    normalize: bool = False  # L2-normalize the vector

    def validate(self) -> "PoolingParams":
        if self.mode not in POOLING_MODES:
            raise InvalidRequest("pooling", f"must be one of {', '.join(POOLING_MODES)}, got {self.mode!r}")
        if not isinstance(self.normalize, bool):
            raise InvalidRequest("normalize", f"must be true or false, got {self.normalize!r}")
        return self

    @property
    def every_row(self) -> bool:
        """It pools rows before the last: a cached prefix would hide them, so none is used."""
        return self.mode != "last"


@dataclasses.dataclass
class Completion:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int
    cached_tokens: int
    metrics: dict[str, float]  # arrival_time, queue_s, ttft_s, prefill_s, tpot_s, e2e_s
    logprobs: list[dict[str, Any]] | None = None
    error: str | None = None
    # params.prompt_logprobs: one entry per prompt token, None for the first (nothing before it)
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    index: int = 0  # which of the params.n samples
    embedding: Any = None  # a pooling request's vector: numpy float32 [hidden] (engine/pooling/)


@dataclasses.dataclass
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    completion: Completion | None = None  # set when finished
    logprobs: list[dict[str, Any]] | None = None
    raw_logprobs: list[tuple] | None = None  # Engine.defer_text: (logprob, top ids, top logprobs) per token
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache (once admitted)
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # on the first token's output
    index: int = 0  # which of the params.n samples (request_id is then "<parent_id>#<index>")
    parent_id: str | None = None  # the id add_request returned for an n > 1 request


class Status:
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """One request's host-side state: tokens, progress, pages, stop state, timings.

    `num_computed` counts tokens whose K/V sit in the request's pages. The request needs
    compute while num_computed < num_tokens; a step whose chunk reaches num_tokens samples.
    There is no prefill phase: a decode is just a chunk of one token.
    """

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 priority: int = 0, arrival_seq: int = 0, seed: int = 0, eos_token_ids=()):
        import time

        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.priority = priority
        self.arrival_seq = arrival_seq
        self.seed = seed  # params.seed, or one drawn by the engine
        self.eos_token_ids = () if params.ignore_eos else tuple(eos_token_ids)
        self.output_ids: list[int] = []
        self.num_computed = 0
        self.in_flight = 0  # tokens sampled on the device, not yet known here (async scheduling)
        self.pending_row = -1  # async scheduling: the latest in-flight token's row in its step's output
        self.pages: list[int] = []  # page ids in its data replica's pool
        self.replica = 0  # the data replica that holds its pages (engine/scheduler/replicas.py)
        self.page_hashes: list[bytes] = []
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.cached_tokens: int | None = None  # set at first admission
        self.num_preemptions = 0
        self.logprobs: list[dict[str, Any]] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[dict[str, Any] | None] | None = (
            [None] * len(self.prompt_ids) if params.prompt_logprobs is not None else None)
        self.index = 0  # n > 1: which sample, and the id add_request returned for them all
        self.parent_id: str | None = None
        self.prefill_after: Request | None = None  # a sibling sample whose prompt pages it waits to share
        self.state_slot: int | None = None  # its recurrent-state slot while running (linear-attention hybrids)
        # a hybrid's second slot once it proposes: its state before a verification (engine/scheduler/verification.py)
        self.spec_slot: int | None = None
        self.lora_slot = 0  # its adapter's device slot (0 = none; engine/lora/slots.py), fixed while it lives
        self.lora_key: str | None = None  # its adapter's name and load, mixed into its prefix hashes
        self.images = None  # its prompt's images (engine/vision/prompt.py PromptImages), None: text only
        self.pooling: PoolingParams | None = None  # a pooling request (engine/pooling/): prefilled, never decoded
        self.pool_parts: list[tuple] = []  # its chunks' (start, end, sum [E]) (engine/pooling/vectors.py)
        self.embedding = None  # its vector once its prompt is done
        self.spec_backoff = None  # its speculative proposals' recent acceptance (engine/speculative/policy.py)
        self.spec_suffix = None  # its tokens as suffix decoding searches them (engine/speculative/suffix.py)
        # the MTP proposer's guess (engine/speculative/mtp_step.py): (token, the num_tokens it follows)
        self.mtp_draft: tuple[int, int] | None = None
        self.matcher = None  # llguidance LLMatcher of a structured_output request (engine/structured_output.py)
        # text
        self.detok = None
        self.text = ""  # emitted text (never includes a stop string)
        self.pending_text = ""  # decoded but held back: could be the start of a stop string
        # timings (perf_counter)
        self.arrival_wall = time.time()
        self.arrival = time.perf_counter()
        self.first_scheduled: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.finished_at: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        return self.num_tokens - self.num_computed

    def token(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    def metrics(self) -> dict[str, float]:
        end = self.finished_at or self.last_token or self.arrival
        m = {"arrival_time": self.arrival_wall, "e2e_s": end - self.arrival,
             "num_preemptions": float(self.num_preemptions)}
        if self.first_scheduled is not None:
            m["queue_s"] = self.first_scheduled - self.arrival
        if self.first_token is not None:
            m["ttft_s"] = self.first_token - self.arrival
            if self.first_scheduled is not None:
                m["prefill_s"] = self.first_token - self.first_scheduled
            n = len(self.output_ids)
            m["tpot_s"] = (self.last_token - self.first_token) / (n - 1) if n > 1 else 0.0
        return m

    def completion(self) -> Completion:
        return Completion(self.request_id, list(self.output_ids), self.text, self.finish_reason or "abort",
                          len(self.prompt_ids), self.cached_tokens or 0, self.metrics(),
                          logprobs=self.logprobs, error=self.error, prompt_logprobs=self.prompt_logprobs,
                          index=self.index, embedding=self.embedding)
