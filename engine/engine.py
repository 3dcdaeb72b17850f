"""Engine: PLACEHOLDER built on engine/simple.py (one prompt at a time, greedy/temperature).

The scheduler-driven engine (issue 4) replaces this file; the public API stays.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from engine.config import load_config
from engine.loading import build_model, build_tokenizer, validate_prompt
from engine.request import Completion, RequestOutput, SamplingParams
from engine.simple import generate_one
from models.kv_cache import KVCache


class Engine:
    def __init__(self, config, progress: bool = True):
        self.config = config
        self.model = build_model(config, progress=progress)
        self.tokenizer = build_tokenizer(config)
        self.kv_cache = KVCache.create(config.model, config.engine.num_pages, config.engine.page_size)
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config="tiny", model_path=None, overrides=None, progress: bool = True) -> "Engine":
        return cls(load_config(config, overrides, model_path), progress=progress)

    def _encode(self, prompt) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]

    def stream(self, prompt, params: SamplingParams = SamplingParams()) -> Iterator[RequestOutput]:
        params.validate(self.config.model.vocab_size)
        ids = self._encode(prompt)
        validate_prompt(ids, self.config.model.vocab_size, self.config.engine.max_model_len)
        rng = np.random.default_rng(params.seed)

        def sample(logits):
            if params.temperature == 0:
                return int(jnp.argmax(logits))
            p = np.asarray(jax.nn.softmax(logits / params.temperature), np.float64)
            return int(rng.choice(len(p), p=p / p.sum()))

        start = time.perf_counter()
        eos = () if params.ignore_eos else self.config.model.eos_token_id
        max_tokens = min(params.max_tokens, self.config.engine.max_model_len - len(ids))
        out, self.kv_cache = generate_one(self.model, ids, self.kv_cache, max_tokens,
                                          eos_token_ids=eos, sample=sample)
        detok = self.tokenizer.detokenizer()
        rid = str(next(self._ids))
        for i, t in enumerate(out):
            yield RequestOutput(rid, [t], detok.feed([t]))
        tail = detok.flush()
        reason = "stop" if out and out[-1] in eos else "length"
        text = self.tokenizer.decode(out)
        completion = Completion(rid, out, text, reason, len(ids), 0,
                                {"e2e_s": time.perf_counter() - start})
        yield RequestOutput(rid, [], tail, finished=True, completion=completion)

    def generate(self, prompts, params: SamplingParams = SamplingParams()) -> list[Completion]:
        results = []
        for p in prompts:
            for o in self.stream(p, params):
                if o.finished:
                    results.append(o.completion)
        return results

    def abort(self, request_id: str) -> bool:
        return False

    def stats(self) -> dict:
        n = self.config.engine.num_pages
        return {"pages_total": n, "pages_free": n, "num_running": 0, "num_waiting": 0}
