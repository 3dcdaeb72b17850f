"""Builds the model and tokenizer a Config describes: HF weights, or a seeded random init."""

from __future__ import annotations

import time

from engine.config import Config
from engine.request import InvalidRequest
from engine.tokenizer import load_tokenizer
from models.llama import Llama


def build_model(config: Config, place=None, progress: bool = True) -> Llama:
    impl = config.engine.attention_impl
    if config.model_path:
        from models.checkpoint import default_place, load_hf_params

        return load_hf_params(config.model_path, config.model, attention_impl=impl,
                              place=place or default_place, progress=progress)
    return Llama(config.model, attention_impl=impl)


def build_tokenizer(config: Config):
    return load_tokenizer(config.model, config.model_path)


def validate_prompt(token_ids: list[int], vocab_size: int, max_model_len: int, max_tokens: int = 0) -> None:
    """Rejects what would otherwise fail deep inside a jitted step or be silently cut."""
    if not token_ids:
        raise InvalidRequest("prompt", "is empty")
    bad = [t for t in token_ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise InvalidRequest("prompt", f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise InvalidRequest("prompt", f"has {len(token_ids)} tokens; max_model_len is {max_model_len} "
                             "(prompt plus at least one generated token must fit)")


def timed(label: str, fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start
