"""Pixels for Gemma 4's tower, as transformers' Gemma4ImageProcessorPil makes them: each image
resized keeping its aspect ratio to the largest size whose sides are multiples of
pooling x patch and whose patch count is at most max_soft_tokens x pooling^2 (PIL bicubic
on uint8; an image already that size is not resized), rescaled by 1/255 in f64 then f32,
not normalized (the tower maps [0, 1] to [-1, 1] itself), cut into P x P x C patches in
raster order with their (x, y) coordinates, padded to max_patches. An image's soft-token
count (its prompt rows) is (h / (k P)) x (w / (k P))."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

from jaxfill.engine.vision.image_processor import BICUBIC, to_rgb

SOFT_TOKENS = (70, 140, 280, 560, 1120)  # the processor's allowed max_soft_tokens


@dataclasses.dataclass(frozen=True)
class Gemma4ImageSettings:
    patch_size: int = 16
    pooling: int = 3
    max_soft_tokens: int = 280
    rescale: float = 1 / 255
    resample: int = BICUBIC

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling ** 2


def gemma4_settings(model_dir: str, vision: dict) -> Gemma4ImageSettings:
    """The checkpoint's preprocessor_config.json (or processor_config.json's image_processor),
    else the processor's defaults with the tower's patch and pooling sizes."""
    base = Gemma4ImageSettings(patch_size=vision.get("patch_size", 16), pooling=vision.get("pooling_kernel_size", 3))
    p, path = {}, None
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = os.path.join(model_dir, name)
        if os.path.exists(path):
            with open(path) as f:
                p = json.load(f)
            p = p.get("image_processor", p)
            break
    if not p:
        return base
    for key in ("do_resize", "do_rescale", "do_convert_rgb"):
        if p.get(key, True) is not True:
            raise ValueError(f"{path}: {key}={p[key]} is not supported (only Gemma 4's defaults are)")
    if p.get("do_normalize", False) and (p.get("image_mean", [0.0] * 3) != [0.0] * 3
                                         or p.get("image_std", [1.0] * 3) != [1.0] * 3):
        raise ValueError(f"{path}: do_normalize with image_mean {p.get('image_mean')} / image_std "
                         f"{p.get('image_std')} is not supported (Gemma 4 reads pixels in [0, 1])")
    s = dataclasses.replace(base, max_soft_tokens=int(p.get("max_soft_tokens", base.max_soft_tokens)),
                            rescale=p.get("rescale_factor", base.rescale), resample=p.get("resample", base.resample))
    if s.max_soft_tokens not in SOFT_TOKENS:
        raise ValueError(f"{path}: max_soft_tokens={s.max_soft_tokens} must be one of {SOFT_TOKENS}")
    for key, ours in (("patch_size", s.patch_size), ("pooling_kernel_size", s.pooling)):
        if p.get(key, ours) != ours:
            raise ValueError(f"{path}: {key}={p[key]} differs from the vision tower's {ours}")
    return s


def target_size(h: int, w: int, s: Gemma4ImageSettings) -> tuple[int, int]:
    """(height, width) the processor resizes an h x w image to (get_aspect_ratio_preserving_size)."""
    target_px = s.max_patches * s.patch_size ** 2
    factor = math.sqrt(target_px / (h * w))
    side = s.pooling * s.patch_size
    th, tw = int(math.floor(factor * h / side)) * side, int(math.floor(factor * w / side)) * side
    longest = (s.max_patches // s.pooling ** 2) * side
    if th == 0 and tw == 0:
        raise ValueError(f"an image of {h} x {w} resizes to 0 x 0")
    if th == 0:
        th, tw = side, min(int(math.floor(w / h)) * side, longest)
    elif tw == 0:
        tw, th = side, min(int(math.floor(h / w)) * side, longest)
    if th * tw > target_px:
        raise ValueError(f"an image of {h} x {w} resizes to {th} x {tw}, over {s.max_patches} patches")
    return th, tw


def patches(image, s: Gemma4ImageSettings) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
    """(patches [max_patches, P*P*3] f32, xy [max_patches, 2] int32 (-1 on padding), the
    patch grid (rows, cols)) of one image."""
    from PIL import Image
    rgb = to_rgb(image)
    h, w = target_size(rgb.shape[0], rgb.shape[1], s)
    if (h, w) != rgb.shape[:2]:
        rgb = np.asarray(Image.fromarray(rgb).resize((w, h), resample=s.resample))
    x = (rgb.astype(np.float64) * s.rescale).astype(np.float32)  # [H, W, C]
    p, rows, cols = s.patch_size, h // s.patch_size, w // s.patch_size
    flat = x.reshape(rows, p, cols, p, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols, p * p * 3)
    gx, gy = np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy")
    xy = np.stack([gx, gy], -1).reshape(-1, 2)
    pad = s.max_patches - rows * cols
    return (np.pad(flat, ((0, pad), (0, 0))), np.pad(xy, ((0, pad), (0, 0)), constant_values=-1).astype(np.int32),
            (rows, cols))
