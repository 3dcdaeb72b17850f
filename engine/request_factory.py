"""The one request factory: checks a request, names it and draws its seed.

A request is checked outside the engine lock (tokenizing a long prompt must not hold up
the stepping thread) and built under it, right before the scheduler takes it (add, or
admit_prefilled), so a refused request consumes no id and no seed.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

from jaxfill.engine.loading import validate_prompt
from jaxfill.engine.request import InvalidRequest, PoolingParams, Request, SamplingParams
from jaxfill.engine.structured_output import GrammarCompiler


NO_VISION_TOWER = "this model has no vision tower: it reads text only (docs/vision.md)"


class PromptIds(list):
    """A prompt's ids with its images (engine/vision/prompt.py PromptImages) attached."""
    images = None


class RequestFactory:
    def __init__(self, config, tokenizer, unfinished: dict, vision=None):
        self.settings = config.engine
        self.vocab_size = config.model.vocab_size
        self.eos_token_ids = config.model.eos_token_id or ()
        self.has_head = config.model.embeddings.head
        self.tokenizer = tokenizer
        self.unfinished = unfinished  # the scheduler's registry of unfinished requests (read only)
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        self._seeds = random.Random(self.settings.seed)
        self.grammars = GrammarCompiler(self.vocab_size)
        self.vision = vision  # the model's VisionTower (engine/vision/tower.py), None: text only

    def check(self, prompt, params: SamplingParams | None = None, priority: int = 0) -> tuple[list[int], SamplingParams]:
        """Everything about one request that needs no queue: (prompt ids, params)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequest("params", f"must be SamplingParams, got {type(params).__name__}")
        params.validate(self.vocab_size)
        if not self.has_head:
            raise InvalidRequest("prompt", "this model has no LM head (an embedding backbone): it cannot generate; "
                                 "use Engine.embed or Engine.score")
        if params.logprobs == -1:  # every token: a vocabulary this small fits the sampler's top-N
            params = dataclasses.replace(params, logprobs=self.vocab_size)
        ids = self._encode(prompt)
        if isinstance(ids, PromptIds) and (params.truncate_prompt_tokens is not None or
                                           params.prompt_logprobs is not None):
            raise InvalidRequest("images", "truncate_prompt_tokens and prompt_logprobs are not supported "
                                           "with images")
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens:]  # the caller asked to keep the end
        s = self.settings
        self._check_fits(ids)
        if not isinstance(priority, int):
            raise InvalidRequest("priority", f"must be an integer, got {priority!r}")
        if params.structured_output is not None:
            self.grammars.check(params.structured_output, self.tokenizer)
        rows = min(s.prompt_logprobs_rows, s.max_num_batched_tokens)
        if params.prompt_logprobs is not None and not s.chunked_prefill and len(ids) - 1 > rows:
            raise InvalidRequest("prompt_logprobs", f"a prompt over {rows + 1} tokens needs chunked prefill "
                                                    f"(engine.prompt_logprobs_rows = {s.prompt_logprobs_rows})")
        return ids, params

    def check_pooling(self, prompt, pooling: PoolingParams) -> list[int]:
        """A pooling request's prompt ids (engine/pooling/): the same limits as a prompt to
        generate from, so a refused input never reaches the scheduler or a page."""
        if not isinstance(pooling, PoolingParams):
            raise InvalidRequest("pooling", f"must be PoolingParams, got {type(pooling).__name__}")
        pooling.validate()
        ids = self._encode(prompt)
        self._check_fits(ids)
        return ids

    def _check_fits(self, ids: list[int]) -> None:
        s = self.settings
        validate_prompt(ids, self.vocab_size, s.max_model_len)
        need = -(-(len(ids) + 1) // s.page_size)
        if need > s.num_pages - 1:
            raise InvalidRequest("prompt", f"needs {need} KV pages; the pool has {s.num_pages - 1} "
                                 f"(engine.num_pages x engine.page_size)")

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, PromptIds):  # checked once already (Engine.generate, then add_request)
            return prompt
        if isinstance(prompt, dict):
            return self._with_images(prompt)
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        try:
            return [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise InvalidRequest("prompt", "must be a string or a list of token ids") from None

    def new_samples(self, ids: list[int], params: SamplingParams, request_id: str | None, priority: int,
                    with_text: bool, share_prefill: bool) -> list[Request]:
        """[engine lock] params.n requests "<id>#<i>", sample i seeded params.seed + i (or
        drawn). share_prefill (prefix caching on): samples 1.. wait until sample 0 has
        prefilled, then take its full prompt pages from the prefix cache, so the prompt is
        computed once and each sample only its last partial page."""
        parent = request_id if request_id is not None else self._fresh_id()
        if not isinstance(parent, str) or not parent:
            raise InvalidRequest("request_id", "must be a non-empty string")
        names = [f"{parent}#{i}" for i in range(params.n)]
        if parent in self.unfinished or any(x in self.unfinished for x in names):
            raise InvalidRequest("request_id", f"{parent!r} is already in flight")
        samples = []
        for i, name in enumerate(names):
            seed = None if params.seed is None else (params.seed + i) % 2**63
            req = self.new(ids, dataclasses.replace(params, n=1, seed=seed), name, priority, with_text)
            req.index, req.parent_id = i, parent
            req.prefill_after = samples[0] if samples and share_prefill else None
            samples.append(req)
        return samples

    def _fresh_id(self) -> str:
        request_id = f"req-{next(self._ids)}"
        while request_id in self.unfinished:
            request_id = f"req-{next(self._ids)}"
        return request_id

    def new(self, ids: list[int], params: SamplingParams, request_id: str | None = None, priority: int = 0,
            with_text: bool = True) -> Request:
        """[engine lock] ids and params from check(); refuses an id in flight. with_text=False
        (Engine.defer_text): no detokenizer, the caller makes the text."""
        if request_id is None:
            request_id = self._fresh_id()
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidRequest("request_id", "must be a non-empty string")
        if request_id in self.unfinished:
            raise InvalidRequest("request_id", f"{request_id!r} is already in flight")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        req = Request(request_id, ids, params, priority, next(self._arrivals), seed,
                      eos_token_ids=self.eos_token_ids)
        req.detok = self.tokenizer.detokenizer(ids) if with_text else None
        req.images = getattr(ids, "images", None)
        if params.structured_output is not None:
            req.matcher = self.grammars.matcher(self.grammars.check(params.structured_output, self.tokenizer),
                                                self.tokenizer)
        return req

    def _with_images(self, prompt: dict) -> list[int]:
        """{"prompt": text or ids, "images": [PIL image or [H, W, 3] uint8 array, ...]}: the ids
        with each image's placeholder expanded, the images attached (PromptIds)."""
        unknown = set(prompt) - {"prompt", "images"}
        if unknown:
            what = "video is not supported (images only)" if {"videos", "video"} & unknown else \
                f"unknown keys {sorted(unknown)}"
            raise InvalidRequest("prompt", f"a prompt dict holds 'prompt' and 'images': {what}")
        if "prompt" not in prompt:
            raise InvalidRequest("prompt", "a prompt dict needs its 'prompt' (text or token ids)")
        images = list(prompt.get("images") or [])
        text = prompt["prompt"]
        if isinstance(text, str) and images and self.vision is not None:
            text = self.vision.mark_text(text)  # what the model's processor adds around a placeholder in text
        ids = self._encode(text)
        return self.expand_images(ids, images) if images else ids

    def expand_images(self, ids: list[int], images: list) -> list[int]:
        """The ids with each image's placeholder expanded, the images attached (PromptIds):
        the Python API's dict prompt and the serving protocols (serving/images.py) share it,
        so both expand the same way. Pure host work, safe outside the engine lock."""
        if self.vision is None:
            raise InvalidRequest("images", NO_VISION_TOWER)
        try:
            expanded, info = self.vision.expand(ids, images)
        except (ValueError, TypeError) as e:
            raise InvalidRequest("images", str(e)) from None
        out = PromptIds(expanded)
        out.images = info
        return out
