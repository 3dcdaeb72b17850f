"""The encoder-output cache both vision towers share: an image seen again (the next turn of
a chat, the same picture in many prompts) is never re-encoded, and an image costs far more
encoder work than its prompt rows cost the prefill (benchmarks/RESULTS.md, vision)."""

from __future__ import annotations

import collections
from typing import Any, Callable


class EncoderCache:
    """Least-recently-used outputs keyed by an image's digest (engine/vision/prompt.py
    image_key), with the hit and miss counts Engine.stats reports."""

    def __init__(self, capacity: int = 64):
        self.capacity = capacity  # images whose output is kept
        self._outputs: collections.OrderedDict[bytes, Any] = collections.OrderedDict()
        self.hits = self.misses = 0

    def get_or_encode(self, key: bytes, encode: Callable[[], Any]) -> Any:
        got = self._outputs.get(key)
        if got is not None:
            self.hits += 1
            self._outputs.move_to_end(key)
            return got
        self.misses += 1
        got = self._outputs[key] = encode()
        while len(self._outputs) > self.capacity:
            self._outputs.popitem(last=False)
        return got

    def clear(self) -> None:
        self._outputs.clear()

    def stats(self) -> dict:
        return {"encoder_cache_hits": self.hits, "encoder_cache_misses": self.misses,
                "encoder_cache_images": len(self._outputs)}
