"""What a step's rows bring from the vision side into the decoder (models/decoder.py).

`VisionRows` rides beside tokens and positions for a model with multimodal rope on every
step: its (t, h, w) positions (decode rows too: text after an image turns from the image's
largest position + 1), and the image rows when a step holds some. A step without image
rows passes images=None (its own compiled program), so decode steps carry no [T, E]
arrays. Gemma 3 (plain rope) passes VisionRows only on steps with image rows: the rows and
each row's key limit (its image is attended both ways).
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
    # [] int32 (Gemma 4's per-layer inputs): the token id image rows read there (its pad id); None: their own
    pad_id: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VisionRows:
    mrope: jax.Array | None  # [3, T] int32: (t, h, w) positions of every row; None: plain rope (Gemma 3)
    images: ImageRows | None = None
    # [T] int32 (Gemma 3): the last key position each row sees, past its own for an image row
    # (its whole image, attended both ways); -1 elsewhere (causal). None: causal everywhere
    key_limits: jax.Array | None = None
