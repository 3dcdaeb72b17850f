"""The vision side of an engine: the encoder, its per-image output cache, and each step's
VisionRows (models/vision/rows.py).

The encoder runs outside the step, once per image (padded to one of 4 patch counts per
octave, so a few compiled shapes serve every image size): a prompt's image may be split across
prefill chunks (or recomputed after preemption), and its rows then read the cached output
by their offset in the image. Entries are keyed by the image's digest (ImageSpan.key), so a
second prompt with the same image is a hit; `hits` / `misses` count them (Engine.stats).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxfill.engine.vision.encoder_cache import EncoderCache
from jaxfill.engine.vision.image_processor import ImageSettings
from jaxfill.engine.vision.prompt import ImageSpan, expand
from jaxfill.models.vision import grid
from jaxfill.models.vision.qwen3_vl import VisionEncoder
from jaxfill.models.vision.rows import ImageRows, VisionRows


def patch_bucket(n: int) -> int:
    """Rows an image of n patches is padded to: n rounded up to an eighth of the next power
    of two and to 64 (64, 128, ..., 512, 640, 768, 896, 1024, 1280, ...: 28 programs up to
    16384 patches, 9 with powers of two), so images of any size share a few compiled encoders
    and pad under 64 rows or a quarter (7056 patches: 7168, not 8192). The padding is segment -1 (models/vision/attention.py: it sees
    nothing and no row sees it, its key blocks are skipped) and its merged rows are dropped,
    so the image's rows are exactly the unpadded ones."""
    step = max(64, (1 << (n - 1).bit_length()) // 8)
    return -(-n // step) * step


@functools.partial(jax.jit, static_argnums=0)
def _encode(graphdef, state, pixels, rows_cols, taps, tap_weights, segments):
    return nnx.merge(graphdef, state)(pixels, rows_cols, taps, tap_weights, segments)


class VisionTower:
    def __init__(self, encoder: VisionEncoder, settings: ImageSettings, image_token_id: int, capacity: int = 64):
        self.graphdef, self.state = nnx.split(encoder)
        self.cfg = encoder.cfg
        self.settings = settings
        self.image_token_id = image_token_id
        self.cache = EncoderCache(capacity)

    def mark_text(self, text: str) -> str:  # Qwen3-VL's processor adds no text around a placeholder
        return text

    def expand(self, ids: list[int], images: list):  # (expanded ids, PromptImages): engine/vision/prompt.py
        return expand(ids, images, self.settings, self.image_token_id)

    @property
    def depth(self) -> int:  # DeepStack layers
        return len(self.cfg.deepstack_visual_indexes)

    def encode(self, span: ImageSpan) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [n, out], deepstack [L', n, out]) of one image, from the cache or the encoder."""
        return self.cache.get_or_encode(span.key, lambda: self._encode(span))

    def _encode(self, span: ImageSpan) -> tuple[np.ndarray, np.ndarray]:
        lay = grid.layout([span.grid], self.cfg.spatial_merge_size, self.cfg.grid_side)
        n = span.pixels.shape[0]
        rows = patch_bucket(n)
        pad = ((0, rows - n),)
        tokens, deep = _encode(self.graphdef, self.state, jnp.asarray(np.pad(span.pixels, pad + ((0, 0),))),
                               np.pad(lay.rows_cols, pad + ((0, 0),)), np.pad(lay.taps, pad + ((0, 0),)),
                               np.pad(lay.tap_weights, pad + ((0, 0),)),
                               np.pad(lay.segments, pad, constant_values=-1))  # padding: no attention
        m = n // self.cfg.merge_unit
        return np.asarray(tokens[:m], np.float32), np.asarray(deep[:, :m], np.float32)

    def stats(self) -> dict:
        return self.cache.stats()

    def rows(self, seqs, t_pad: int) -> VisionRows:
        """The step's VisionRows, its rows laid out as engine/batch.py lays out the
        scheduled chunks `seqs` (SchedulerOutput.seqs): positions for every row, image rows
        only when some chunk covers part of an image."""
        mrope = np.zeros((3, t_pad), np.int32)
        hits: list[tuple[int, ImageSpan, int, int]] = []  # (step row, span, first, last) image rows
        row = 0
        for sch in seqs:
            req, start, n = sch.req, sch.start, sch.num_new
            images = req.images
            if images is None:
                mrope[:, row:row + n] = np.arange(start, start + n, dtype=np.int32)
            else:
                mrope[:, row:row + n] = images.positions(start, start + n)
                for span in images.spans:
                    lo, hi = max(start, span.offset), min(start + n, span.offset + span.length)
                    if lo < hi:
                        hits.append((row + lo - start, span, lo - span.offset, hi - span.offset))
            row += n
        if not hits:
            return VisionRows(mrope)
        e = self.cfg.out_hidden_size
        embeds = np.zeros((t_pad, e), np.float32)
        deep = np.zeros((self.depth, t_pad, e), np.float32)
        mask = np.zeros(t_pad, bool)
        for at, span, lo, hi in hits:
            tokens, stacked = self.encode(span)
            embeds[at:at + hi - lo] = tokens[lo:hi]
            deep[:, at:at + hi - lo] = stacked[:, lo:hi]
            mask[at:at + hi - lo] = True
        return VisionRows(mrope, ImageRows(embeds, mask, deep))
