"""The Qwen3-VL vision tower against transformers' Qwen3VLVisionModel (f32, random init):
two images of different sizes in one call, so the per-image attention segments, the
resampled position table and the 2D rotary all show; DeepStack features too."""

from __future__ import annotations

import numpy as np
import pytest

from vision_models import config_json, hf_model, tiny_qwen3_vl, torch

from jaxfill.models.vision import grid
from jaxfill.models.vision.config import vision_config
from jaxfill.models.vision.weights import load_encoder


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_qwen3_vl(str(tmp_path_factory.mktemp("qwen3_vl")))


def _run_both(ckpt, grids):
    cfg = vision_config(config_json(ckpt))
    rng = np.random.default_rng(0)
    n = sum(t * h * w for t, h, w in grids)
    pixels = rng.standard_normal((n, cfg.patch_dim)).astype(np.float32)
    hf = hf_model(ckpt).model.visual
    with torch.no_grad():
        out = hf(torch.from_numpy(pixels), grid_thw=torch.tensor(grids), return_dict=True)
    lay = grid.layout(grids, cfg.spatial_merge_size, cfg.grid_side)
    enc = load_encoder(ckpt, cfg)
    tokens, deep = enc(pixels, lay.rows_cols, lay.taps, lay.tap_weights, lay.segments)
    return out, np.asarray(tokens), np.asarray(deep)


def _close(ours, ref):
    ref = np.asarray(ref)
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err < 1e-5, err


def test_two_images_of_different_sizes_match_transformers(ckpt):
    grids = [(1, 6, 8), (1, 10, 4)]  # 48 + 40 patches: rows, cols, and the table resampled differently
    out, tokens, deep = _run_both(ckpt, grids)
    assert tokens.shape == (22, 64) and deep.shape == (2, 22, 64)
    _close(tokens, out.pooler_output.numpy())
    for ours, ref in zip(deep, out.deepstack_features):
        _close(ours, ref.numpy())


def test_segments_keep_images_apart(ckpt):
    """The first image's tokens are the same alone as beside another image."""
    _, both, _ = _run_both(ckpt, [(1, 6, 8), (1, 10, 4)])
    _, alone, _ = _run_both(ckpt, [(1, 6, 8)])
    _close(both[:12], alone)
