"""The plainest prefill-then-decode loop on the paged cache: one prompt at a time.

It exists for notebooks and as the ground truth the scheduler-driven Engine is tested
against; it is not how the server runs (see engine/engine.py).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxfill.models.forward import forward
from jaxfill.models.kv_cache import KVCache, dealt_pages, single_sequence_metadata


def bucket(n: int, minimum: int = 16) -> int:
    """Smallest multiple of `minimum` holding n, rounded to a power-of-two multiple of 8ths."""
    size = minimum
    while size < n:
        size *= 2
    # Between powers of two, step in eighths so a 1100-token prompt is not padded to 2048.
    step = max(size // 8, minimum)
    return min(size, -(-n // step) * step)


def prefill_chunks(model, prompt: list[int], cache: KVCache, pages: list[int],
                   chunk: int | None = None, start: int = 0, step_rows: int | None = None):
    """Runs `prompt[start:]` through the model in chunks; returns (last logits [V], cache).
    `step_rows`: every step padded to that many rows instead of its bucket, so prompts of
    any length (up to `chunk` <= step_rows per step) share one compiled program."""
    graphdef, state = nnx.split(model)
    page_size = cache.page_size
    chunk = chunk or len(prompt) - start
    if step_rows:
        chunk = min(chunk, step_rows)
    logits = None
    pos = start
    while pos < len(prompt):
        n = min(chunk, len(prompt) - pos)
        padded = step_rows or bucket(n)
        tokens = np.zeros(padded, np.int32)
        tokens[:n] = prompt[pos:pos + n]
        positions = np.zeros(padded, np.int32)
        positions[:n] = np.arange(pos, pos + n)
        meta = single_sequence_metadata(n, pos, pages, page_size, pad_to=padded)
        logits, cache = forward(graphdef, state, jnp.asarray(tokens), jnp.asarray(positions), cache, meta)
        pos += n
    return logits[0], cache


def generate_one(model, prompt: list[int], cache: KVCache, max_tokens: int,
                 pages: list[int] | None = None, eos_token_ids=(), chunk: int | None = None,
                 sample=None, step_rows: int | None = None):
    """Greedy (or `sample(logits) -> id`) generation; returns (token ids, cache).

    Pages default to 1.. in order (page 0 stays the null page), dealt over the cache's
    'sequence' ranks when it has them (models/kv_cache.dealt_pages). `step_rows`:
    prefill_chunks' (decode steps too: the prompt and every new token then run one
    compiled program).
    """
    page_size = cache.page_size
    needed = -(-(len(prompt) + max_tokens) // page_size)
    pages = list(pages) if pages is not None else dealt_pages(needed, cache.num_pages, cache.page_ranks)
    if len(pages) < needed:
        raise ValueError(f"need {needed} pages for {len(prompt)}+{max_tokens} tokens, got {len(pages)}")
    pick = sample or (lambda logits: int(jnp.argmax(logits)))
    logits, cache = prefill_chunks(model, prompt, cache, pages, chunk, step_rows=step_rows)
    out: list[int] = []
    seq = list(prompt)
    while len(out) < max_tokens:
        token = pick(logits)
        out.append(token)
        seq.append(token)
        if token in eos_token_ids or len(out) == max_tokens:
            break
        logits, cache = prefill_chunks(model, seq, cache, pages, start=len(seq) - 1, step_rows=step_rows)
    return out, cache
