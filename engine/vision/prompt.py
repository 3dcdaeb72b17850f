"""A prompt with images: its placeholders expanded, its images named, its 3-axis positions.

Each image is one `<|image_pad|>` in the caller's ids (as Qwen3-VL's chat template writes
it, between `<|vision_start|>` and `<|vision_end|>`); it becomes as many placeholder rows as
the image has merged tokens, and those rows take the encoder's output (engine/vision/tower.py).

Positions (Qwen3-VL's get_rope_index rule): text rows count on from the previous row as
(p, p, p); an image starting at p gives its row at grid cell (t, r, c) the position
(p + t, p + r, p + c) and the text after it starts at p + max(rows, cols). Rows past the
prompt (its output) are (i + delta) * 3 with delta = max position + 1 - prompt length,
transformers' rope_deltas: the same whether the prompt ran whole, chunked or from cache.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from jaxfill.engine.vision.image_processor import ImageSettings, image_batch


@dataclasses.dataclass(frozen=True)
class ImageSpan:
    offset: int  # the prompt row of its first token
    grid: tuple[int, int, int]  # (t, h, w) patches
    merge: int
    key: bytes  # the digest of its patches and grid: equal images share encoder output and KV
    pixels: np.ndarray  # [t*h*w, C*T*P*P] f32

    @property
    def length(self) -> int:  # merged tokens
        t, h, w = self.grid
        return t * h * w // self.merge ** 2

    @property
    def hash_id(self) -> int:
        """What the image's rows count as in the prefix-cache hash: negative (no token id is),
        from its digest, so different images never chain to the same page hashes."""
        return -1 - int.from_bytes(self.key[:7], "little")


@dataclasses.dataclass(frozen=True)
class PromptImages:
    spans: tuple[ImageSpan, ...]
    mrope: np.ndarray | None  # [3, L] int32: the prompt's (t, h, w) positions; None: plain rope (Gemma 3)
    delta: int  # rows past the prompt: position = row + delta
    # each image's rows attend each other both ways (Gemma 3): a prefill chunk never ends inside one
    whole: bool = False

    def cut(self, start: int, n: int) -> int:
        """With `whole`: n new rows from `start`, cut so the chunk ends before an image it
        would split (0 when it starts inside one it cannot finish: the rows wait for budget);
        otherwise n."""
        if not self.whole:
            return n
        for s in self.spans:
            lo, hi = s.offset, s.offset + s.length
            if start < hi and lo < start + n < hi:
                return max(lo - start, 0)
        return n

    def positions(self, start: int, end: int) -> np.ndarray:  # [3, end - start] int32
        n = self.mrope.shape[1]
        out = np.empty((3, end - start), np.int32)
        inside = min(end, n)
        if start < inside:
            out[:, :inside - start] = self.mrope[:, start:inside]
        first = max(start, n)
        out[:, first - start:] = np.arange(first, end, dtype=np.int32) + self.delta
        return out

    def hash_ids(self, ids: list[int]) -> list[int]:
        """`ids` (the request's tokens so far) with each image row replaced by its image's hash id."""
        out = list(ids)
        for s in self.spans:
            out[s.offset:s.offset + s.length] = [s.hash_id] * len(out[s.offset:s.offset + s.length])
        return out


def image_keys(images: PromptImages | None) -> tuple[bytes, ...]:
    """The digests of a request's images in order (() for text only): two prompts with equal
    ids share prefilled pages only if these are equal too."""
    return () if images is None else tuple(s.key for s in images.spans)


def image_key(pixels: np.ndarray, grid: tuple[int, int, int]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(np.asarray(grid, np.int64).tobytes())
    h.update(np.ascontiguousarray(pixels).tobytes())
    return h.digest()


def rope_index(length: int, spans: list[tuple[int, tuple[int, int, int], int]],
               ) -> tuple[np.ndarray, int]:
    """([3, length] positions, delta) of a prompt of `length` rows whose images are
    (offset, grid, merge), in order and apart."""
    pos = np.empty((3, length), np.int32)
    row, p = 0, 0
    for offset, (t, h, w), merge in spans:
        n = offset - row  # text before the image
        pos[:, row:offset] = np.arange(p, p + n, dtype=np.int32)
        p += n
        gh, gw = h // merge, w // merge
        tt, rr, cc = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        count = t * gh * gw
        pos[:, offset:offset + count] = np.stack([tt.reshape(-1), rr.reshape(-1), cc.reshape(-1)]) + p
        row, p = offset + count, p + max(gh, gw)
    pos[:, row:] = np.arange(p, p + length - row, dtype=np.int32)
    return pos, int(pos.max()) + 1 - length if length else 0


def placeholders(ids: list[int], token: int, images: list, name: str) -> list[int]:
    """Where the prompt's one-per-image placeholder `token` (spelled `name`) stands; a count
    that does not match the images is the caller's mistake, said plainly."""
    at = [i for i, t in enumerate(ids) if t == token]
    if len(at) != len(images):
        raise ValueError(f"the prompt holds {len(at)} image placeholders ({name}, token {token}) for "
                         f"{len(images)} images: one per image")
    if not images:
        raise ValueError("a prompt with images needs at least one")
    return at


def expand(ids: list[int], images: list, settings: ImageSettings,
           image_token_id: int) -> tuple[list[int], PromptImages]:
    """(the expanded ids, their PromptImages) of a prompt with one image_token_id per image."""
    at = placeholders(ids, image_token_id, images, "<|image_pad|>")
    pixels, grids = image_batch(images, settings)
    merge = settings.merge_size
    out, spans, row, first = [], [], 0, 0
    for i, (t, h, w) in enumerate(grids):
        n = t * h * w
        part = pixels[first:first + n]
        first += n
        prev = at[i - 1] + 1 if i else 0
        out += ids[prev:at[i]]
        if spans and len(out) == spans[-1].offset + spans[-1].length:
            raise ValueError("two images with no text between them: put <|vision_end|><|vision_start|> "
                             "(or any token) between their placeholders")
        span = ImageSpan(len(out), (t, h, w), merge, image_key(part, (t, h, w)), part)
        spans.append(span)
        out += [image_token_id] * span.length
    out += ids[at[-1] + 1:]
    mrope, delta = rope_index(len(out), [(s.offset, s.grid, s.merge) for s in spans])
    return out, PromptImages(tuple(spans), mrope, delta)
