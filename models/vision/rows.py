"""What a step's rows bring from the vision side into the decoder (models/decoder.py).

`VisionRows` rides beside tokens and positions only for a model with multimodal rope: its
(t, h, w) positions on every step (decode rows too: text after an image turns from the
image's largest position + 1), and the image rows when a step holds some. A step without
image rows passes images=None (its own compiled program), so decode steps carry no [T, E]
arrays.
"""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ImageRows:
    embeds: jax.Array  # [T, E]: the encoder's token for an image row, anything elsewhere
    mask: jax.Array  # [T] bool: the row is an image token
    deepstack: jax.Array  # [L', T, E]: added after decoder layer l < L' (0 off image rows)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VisionRows:
    mrope: jax.Array  # [3, T] int32: (t, h, w) positions of every row
    images: ImageRows | None = None
