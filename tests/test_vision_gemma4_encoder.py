"""Gemma 4's vision tower and embedder (models/vision/gemma4_vision.py) against transformers'
Gemma4Model.get_image_features (f32, random init, clipped linears and standardization on),
and the host preprocessing against Gemma4ImageProcessorPil (patches, positions and soft-token
counts bit for bit)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from vision_gemma4 import MAX_SOFT, hf_gemma4_vl, tiny_gemma4_vl, torch

from jaxfill.engine.vision.gemma4_images import gemma4_settings, patches
from jaxfill.models.vision.gemma4_vision import gemma4_vision_config, soft_tokens
from jaxfill.models.vision.gemma4_weights import load_gemma4_vision

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_gemma4_vl(str(tmp_path_factory.mktemp("gemma4_vl")))


def _images():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (12, 20, 3), np.uint8),  # grows to 24 x 40: 12 x 20 patches, 60 tokens
            Image.fromarray(rng.integers(0, 256, (50, 17, 4), np.uint8), "RGBA"),  # tall, shrinks, transparency
            rng.integers(0, 256, (5, 70, 3), np.uint8),  # very wide: one pooled row
            rng.integers(0, 256, (32, 32, 3), np.uint8)]  # already a valid size: 16 x 16 patches, 64 tokens


def _settings(ckpt):
    with open(os.path.join(ckpt, "config.json")) as f:
        hf = json.load(f)
    return hf, gemma4_settings(ckpt, hf["vision_config"])


def test_patches_equal_transformers(ckpt):
    from transformers import Gemma4ImageProcessorPil
    ref = Gemma4ImageProcessorPil.from_pretrained(ckpt)(images=_images(), return_tensors="np")
    _, s = _settings(ckpt)
    assert s.max_soft_tokens == MAX_SOFT and s.max_patches == 280
    for i, image in enumerate(_images()):
        px, xy, (rows, cols) = patches(image, s)
        np.testing.assert_array_equal(px, ref["pixel_values"][i])
        np.testing.assert_array_equal(xy, ref["image_position_ids"][i])
        assert rows * cols // 4 == ref["num_soft_tokens_per_image"][i]


def test_tower_and_embedder_equal_transformers(ckpt):
    hf_json, s = _settings(ckpt)
    cfg = gemma4_vision_config(hf_json, s.max_soft_tokens)
    assert cfg.clipped and cfg.standardize
    enc = load_gemma4_vision(ckpt, cfg)
    hf = hf_gemma4_vl(ckpt)
    rng = np.random.default_rng(1)
    for image in _images():
        px, xy, (rows, cols) = patches(image, s)
        px = np.where((xy >= 0).all(-1)[:, None], rng.random(px.shape, np.float32), 0).astype(np.float32)
        with torch.no_grad():
            ref = hf.model.get_image_features(torch.from_numpy(px[None]),
                                              torch.from_numpy(xy[None].astype(np.int64))).pooler_output[0].numpy()
        n = rows * cols // 4
        assert ref.shape == (n, 64)
        ours = np.asarray(enc(px, xy, soft_tokens(xy, 2)))[:n]
        err = np.abs(ours - ref).max() / np.abs(ref).max()
        assert err < 1e-5, err
