"""Host-side image preprocessing against transformers' Qwen2VLImageProcessorPil (what
Qwen3-VL's processor runs without torchvision): pixel_values and image_grid_thw equal, for
images that shrink, grow, stay, and one with transparency."""

from __future__ import annotations

import numpy as np
import pytest

from jaxfill.engine.vision.image_processor import ImageSettings, image_batch, smart_size

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

SETTINGS = ImageSettings(patch_size=8, merge_size=2, min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 64)


def _hf():
    transformers = pytest.importorskip("transformers")
    s = SETTINGS
    return transformers.Qwen2VLImageProcessorPil(
        patch_size=s.patch_size, merge_size=s.merge_size, temporal_patch_size=s.temporal_patch_size,
        size={"shortest_edge": s.min_pixels, "longest_edge": s.max_pixels}, image_mean=list(s.mean),
        image_std=list(s.std))


def _images():
    rng = np.random.default_rng(0)
    big = rng.integers(0, 256, (300, 410, 3), np.uint8)  # over max_pixels: shrinks
    small = rng.integers(0, 256, (20, 50, 3), np.uint8)  # under min_pixels: grows
    exact = rng.integers(0, 256, (64, 96, 3), np.uint8)  # already multiples of 16: no resize
    rgba = Image.fromarray(rng.integers(0, 256, (70, 45, 4), np.uint8), "RGBA")
    return [big, Image.fromarray(small), exact, rgba]


def test_pixel_values_and_grids_equal_transformers():
    images = _images()
    ref = _hf()(images=images, return_tensors="np")
    pixels, grids = image_batch(images, SETTINGS)
    assert [list(g) for g in grids] == ref["image_grid_thw"].tolist()
    np.testing.assert_array_equal(pixels, ref["pixel_values"])


@pytest.mark.parametrize("hw", [(448, 448), (300, 410), (20, 50), (5, 900), (1000, 7)])
def test_smart_size_equals_transformers(hw):
    smart_resize = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl").smart_resize
    if max(hw) / min(hw) > 200:
        with pytest.raises(ValueError):
            smart_size(*hw, 16, 4096, 65536)
        return
    assert smart_size(*hw, 16, 4096, 65536) == smart_resize(*hw, factor=16, min_pixels=4096, max_pixels=65536)


def test_smart_size_bounds_without_transformers():
    """The three branches by hand: kept (rounded), shrunk (floor), grown (ceil)."""
    assert smart_size(100, 60, 16, 1024, 65536) == (96, 64)
    assert smart_size(448, 448, 16, 4096, 65536) == (256, 256)  # beta = 1.75
    assert smart_size(20, 50, 16, 4096, 65536) == (48, 112)  # beta = sqrt(4096 / 1000)
