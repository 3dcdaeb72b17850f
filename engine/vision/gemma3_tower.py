"""Gemma 3's vision side of an engine: each `<start_of_image>` in a prompt expanded to the
processor's image block, the SigLIP encoder's per-image output cache, and each step's
VisionRows (models/vision/rows.py): the image rows and their key limits.

Gemma 3 attends an image's rows to each other both ways (transformers' token_type_ids
mask: causal OR same image; a sliding layer's window still applies from the row). A row
of an image therefore needs the image's later rows in the same step, so an image is
never split over prefill chunks (PromptImages.whole, the scheduler's cut); a prefix-cache
hit may still end inside an image, since the cached rows were computed with the whole
image. Image rows are the encoder's tokens as they are: Gemma scales the text embeddings
by sqrt(hidden) and not the image ones (models/decoder.py adds them after the scale).
The encoder cache is keyed by the image's digest (ImageSpan.key), as engine/vision/tower.py's.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from jaxfill.engine.vision.encoder_cache import EncoderCache
from jaxfill.engine.vision.gemma3_images import Gemma3ImageSettings, pixels
from jaxfill.engine.vision.prompt import ImageSpan, PromptImages, image_key, placeholders
from jaxfill.models.vision.rows import ImageRows, VisionRows
from jaxfill.models.vision.siglip import SiglipEncoder


@functools.partial(jax.jit, static_argnums=0)
def _encode(graphdef, state, image):  # image [3, S, S] -> [mm_tokens, text E]
    return nnx.merge(graphdef, state)(image)


def expand(ids: list[int], images: list, settings: Gemma3ImageSettings, boi: int, image_token: int, eoi: int,
           tokens: int) -> tuple[list[int], PromptImages]:
    """(the expanded ids, their PromptImages): each `boi` in `ids` (one per image, in order)
    becomes boi, `tokens` x image_token, eoi, as processing_gemma3 expands `<start_of_image>`
    (its two newlines before and after are text: Gemma3Tower.mark_text adds them to a text
    prompt; token ids are taken as they are)."""
    at = placeholders(ids, boi, images, "<start_of_image>")
    if image_token in ids or eoi in ids:
        raise ValueError(f"the prompt already holds image tokens ({image_token}) or <end_of_image> ({eoi}): give "
                         "one <start_of_image> per image and the images, not an expanded prompt")
    side = int(round(tokens ** 0.5))
    out, spans, prev = [], [], 0
    for i, image in enumerate(images):
        out += ids[prev:at[i]] + [boi]
        px = pixels(image, settings)
        spans.append(ImageSpan(len(out), (1, side, side), 1, image_key(px, (1, side, side)), px))
        out += [image_token] * tokens + [eoi]
        prev = at[i] + 1
    out += ids[prev:]
    return out, PromptImages(tuple(spans), None, 0, whole=True)


class Gemma3Tower:
    def __init__(self, encoder: SiglipEncoder, settings: Gemma3ImageSettings, boi: int, image_token: int, eoi: int,
                 capacity: int = 64, refused: str | None = None, boi_text: str = "<start_of_image>"):
        self.graphdef, self.state = nnx.split(encoder)
        self.cfg = encoder.cfg
        self.settings = settings
        self.boi, self.image_token_id, self.eoi = boi, image_token, eoi
        self.cache = EncoderCache(capacity)
        self.refused = refused  # the capability table's line refusing images under this config (loading.py)
        self.boi_text = boi_text  # the tokenizer's <start_of_image>
        self.bidirectional = True  # image rows see their whole image (key limits); False: causal (Gemma 4's option)
        self.pad_id = None  # the id image rows read in per-layer inputs (Gemma 4's E models), None: their own

    def mark_text(self, text: str) -> str:
        """A text prompt as processing_gemma3 writes it around each `<start_of_image>`: two
        newlines before it and two after its image's `<end_of_image>`. The image and eoi
        tokens are special (tokenization splits at them), so the newlines right after boi in
        the text tokenize as they do after eoi; expand then puts the image rows and eoi between."""
        return text.replace(self.boi_text, f"\n\n{self.boi_text}\n\n")

    def expand(self, ids: list[int], images: list) -> tuple[list[int], PromptImages]:
        if self.refused:
            raise ValueError(self.refused)
        return expand(ids, images, self.settings, self.boi, self.image_token_id, self.eoi, self.cfg.mm_tokens_per_image)

    def encode(self, span: ImageSpan) -> np.ndarray:  # [mm_tokens, text E] f32
        return self.cache.get_or_encode(
            span.key, lambda: np.asarray(_encode(self.graphdef, self.state, span.pixels), np.float32))

    def stats(self) -> dict:
        return self.cache.stats()

    def rows(self, seqs, t_pad: int) -> VisionRows | None:
        """The step's image rows and key limits, its rows laid out as engine/batch.py lays
        out the scheduled chunks `seqs`; None when no chunk covers an image row."""
        hits = []  # (step row, span, first, last) image rows
        row = 0
        for sch in seqs:
            images, start, n = sch.req.images, sch.start, sch.num_new
            for span in () if images is None else images.spans:
                lo, hi = max(start, span.offset), min(start + n, span.offset + span.length)
                if lo < hi:
                    hits.append((row + lo - start, span, lo - span.offset, hi - span.offset))
            row += n
        if not hits:
            return None
        embeds = np.zeros((t_pad, self.cfg.text_hidden_size), np.float32)
        mask = np.zeros(t_pad, bool)
        limits = np.full(t_pad, -1, np.int32)
        for at, span, lo, hi in hits:
            embeds[at:at + hi - lo] = self.encode(span)[lo:hi]
            mask[at:at + hi - lo] = True
            limits[at:at + hi - lo] = span.offset + span.length - 1  # the image's last row: positions are rows
        deep = np.zeros((0, t_pad, self.cfg.text_hidden_size), np.float32)
        pad = None if self.pad_id is None else np.int32(self.pad_id)
        return VisionRows(None, ImageRows(embeds, mask, deep, pad), limits if self.bidirectional else None)
