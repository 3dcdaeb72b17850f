"""Gemma 3's SigLIP tower and multimodal projector (models/vision/siglip.py) against
transformers' Gemma3Model.get_image_features (f32, random init), and the host
preprocessing against Gemma3ImageProcessorPil (pixel values bit for bit)."""

from __future__ import annotations

import numpy as np
import pytest

from vision_gemma3 import hf_gemma3_vl, tiny_gemma3_vl, torch

from jaxfill.engine.vision.gemma3_images import gemma3_settings, pixels
from jaxfill.models.vision.siglip_weights import load_siglip
from jaxfill.models.vision.siglip import siglip_config

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_gemma3_vl(str(tmp_path_factory.mktemp("gemma3_vl")))


def _images():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (45, 70, 3), np.uint8),  # shrinks and squeezes
            Image.fromarray(rng.integers(0, 256, (20, 25, 4), np.uint8), "RGBA"),  # grows, transparency
            rng.integers(0, 256, (32, 32, 3), np.uint8)]  # already image_size


def test_pixels_equal_transformers(ckpt):
    from transformers import Gemma3ImageProcessorPil
    ref = Gemma3ImageProcessorPil.from_pretrained(ckpt)(images=_images(), return_tensors="np")["pixel_values"]
    s = gemma3_settings(ckpt, 32)
    ours = np.stack([pixels(im, s) for im in _images()])
    np.testing.assert_array_equal(ours, ref)


def test_tower_and_projector_equal_transformers(ckpt):
    import json, os
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = siglip_config(json.load(f))
    enc = load_siglip(ckpt, cfg)
    x = np.random.default_rng(1).standard_normal((2, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        ref = hf_gemma3_vl(ckpt).model.get_image_features(torch.from_numpy(x)).pooler_output.numpy()
    assert ref.shape == (2, 16, 64)
    for i in range(2):
        ours = np.asarray(enc(x[i]))
        err = np.abs(ours - ref[i]).max() / np.abs(ref[i]).max()
        assert err < 1e-5, err
