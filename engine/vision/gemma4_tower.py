"""Gemma 4's vision side of an engine: each image placeholder (the config's image_token_id,
`<|image|>`) expanded as processing_gemma4 expands it, to `<|image>`, the image's soft
tokens, `<image|>`; the tower's per-image output cache; each step's image rows.

Gemma 3's structure (engine/vision/gemma3_tower.py: the step's rows, the encoder cache keyed
by the image's digest), with Gemma 4's differences: an image is as many soft tokens as its
aspect-kept size gives (engine/vision/gemma4_images.py), and its rows attend each other
both ways only when the text config sets use_bidirectional_attention="vision", and then on
the sliding layers only (full layers stay causal; the model's image_limits_sliding_only).
Then an image is never split over prefill chunks (PromptImages.whole); with causal image
rows it may be. Image rows are the embedder's output unscaled (transformers scatters them
after the text embedding's sqrt(hidden) scale). In the "E" models' per-layer inputs an
image row reads the pad token's id.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from jaxfill.engine.vision.gemma3_tower import Gemma3Tower
from jaxfill.engine.vision.gemma4_images import Gemma4ImageSettings, patches
from jaxfill.engine.vision.prompt import ImageSpan, PromptImages, image_key, placeholders
from jaxfill.models.vision.gemma4_vision import Gemma4VisionEncoder, soft_tokens


@functools.partial(jax.jit, static_argnums=0)
def _encode(graphdef, state, px, xy, token):  # [M, 3P^2], [M, 2], [M] -> [max soft tokens, text E]
    return nnx.merge(graphdef, state)(px, xy, token)


def expand(ids: list[int], images: list, settings: Gemma4ImageSettings, boi: int, image_token: int, eoi: int,
           whole: bool) -> tuple[list[int], PromptImages]:
    """(the expanded ids, their PromptImages): each `image_token` in `ids` (one per image, in
    order) becomes boi, the image's soft tokens, eoi."""
    at = placeholders(ids, image_token, images, "<|image|>")
    out, spans, prev = [], [], 0
    for i, image in enumerate(images):
        px, _, (rows, cols) = patches(image, settings)
        grid = (1, rows, cols)
        out += ids[prev:at[i]] + [boi]
        span = ImageSpan(len(out), grid, settings.pooling, image_key(px, grid), px)
        spans.append(span)
        out += [image_token] * span.length + [eoi]
        prev = at[i] + 1
    out += ids[prev:]
    return out, PromptImages(tuple(spans), None, 0, whole=whole)


def patch_xy(rows: int, cols: int, max_patches: int) -> np.ndarray:  # [max_patches, 2] (x, y), -1 padding
    gx, gy = np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy")
    xy = np.stack([gx, gy], -1).reshape(-1, 2)
    return np.pad(xy, ((0, max_patches - rows * cols), (0, 0)), constant_values=-1).astype(np.int32)


class Gemma4Tower(Gemma3Tower):
    def __init__(self, encoder: Gemma4VisionEncoder, settings: Gemma4ImageSettings, boi: int, image_token: int,
                 eoi: int, bidirectional: bool, pad_id: int | None, capacity: int = 64, refused: str | None = None):
        super().__init__(encoder, settings, boi, image_token, eoi, capacity, refused)
        self.bidirectional, self.pad_id = bidirectional, pad_id

    def mark_text(self, text: str) -> str:  # processing_gemma4 adds no text around an image
        return text

    def expand(self, ids: list[int], images: list) -> tuple[list[int], PromptImages]:
        if self.refused:
            raise ValueError(self.refused)
        return expand(ids, images, self.settings, self.boi, self.image_token_id, self.eoi, self.bidirectional)

    def encode(self, span: ImageSpan) -> np.ndarray:  # [soft tokens, text E] f32
        return self.cache.get_or_encode(span.key, lambda: self._encode(span))

    def _encode(self, span: ImageSpan) -> np.ndarray:
        _, rows, cols = span.grid
        xy = patch_xy(rows, cols, self.settings.max_patches)
        out = _encode(self.graphdef, self.state, span.pixels, xy, soft_tokens(xy, self.settings.pooling))
        return np.asarray(out[:span.length], np.float32)
