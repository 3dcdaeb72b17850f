"""Pixels -> the flattened patches Qwen3-VL's tower reads, as transformers' Qwen2VL-family
image processor (its PIL backend) makes them: smart resize (both sides multiples of
patch * merge, pixel count within [min, max], aspect kept), PIL bicubic on uint8, rescale
by 1/255 in f64 then f32, normalize in f32, patches in spatial-merge-block order with each
frame repeated temporal_patch_size times. Pillow is the optional `vision` extra."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

BICUBIC = 3  # PIL.Image.Resampling.BICUBIC


@dataclasses.dataclass(frozen=True)
class ImageSettings:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536  # Qwen3-VL's preprocessor_config
    max_pixels: int = 16777216
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale: float = 1 / 255
    resample: int = BICUBIC


def image_settings(model_dir: str, vision: dict) -> ImageSettings:
    """The checkpoint's preprocessor_config.json, else Qwen3-VL's defaults with the tower's patch sizes."""
    base = ImageSettings(patch_size=vision.get("patch_size", 16),
                         temporal_patch_size=vision.get("temporal_patch_size", 2),
                         merge_size=vision.get("spatial_merge_size", 2))
    path = os.path.join(model_dir, "preprocessor_config.json")
    if not os.path.exists(path):
        return base
    with open(path) as f:
        p = json.load(f)
    size = p.get("size") or {}
    for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        if p.get(key, True) is not True:
            raise ValueError(f"{path}: {key}={p[key]} is not supported (only the Qwen3-VL defaults are)")
    return dataclasses.replace(
        base, patch_size=p.get("patch_size", base.patch_size),
        temporal_patch_size=p.get("temporal_patch_size", base.temporal_patch_size),
        merge_size=p.get("merge_size", base.merge_size),
        min_pixels=size.get("shortest_edge", p.get("min_pixels", base.min_pixels)),
        max_pixels=size.get("longest_edge", p.get("max_pixels", base.max_pixels)),
        mean=tuple(p.get("image_mean", base.mean)), std=tuple(p.get("image_std", base.std)),
        rescale=p.get("rescale_factor", base.rescale), resample=p.get("resample", base.resample))


def smart_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(h, w), both multiples of `factor`, nearest the image's own, shrunk or grown (aspect kept,
    floor when shrinking, ceil when growing) into [min_pixels, max_pixels]."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"an image's aspect ratio must be under 200, got {height} x {width}")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def to_rgb(image) -> np.ndarray:
    """[H, W, 3] uint8 from a PIL image (transparency composited onto white) or an HWC uint8 array."""
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
            raise ValueError(f"an image array must be [H, W, 3] uint8, got {image.shape} {image.dtype}")
        return image
    from PIL import Image
    if not isinstance(image, Image.Image):
        raise TypeError(f"an image is a PIL.Image or an [H, W, 3] uint8 numpy array, not {type(image).__name__}")
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, image.convert("RGBA"))
    return np.asarray(image.convert("RGB"))


def patches(image, s: ImageSettings) -> tuple[np.ndarray, tuple[int, int, int]]:
    """(patches [h*w, C*T*P*P] f32, grid (1, h, w)) of one image."""
    from PIL import Image
    rgb = to_rgb(image)
    h, w = smart_size(rgb.shape[0], rgb.shape[1], s.patch_size * s.merge_size, s.min_pixels, s.max_pixels)
    if (h, w) != rgb.shape[:2]:
        rgb = np.asarray(Image.fromarray(rgb).resize((w, h), resample=s.resample))
    x = (rgb.astype(np.float64) * s.rescale).astype(np.float32)
    x = ((x - np.asarray(s.mean, np.float32)) / np.asarray(s.std, np.float32)).transpose(2, 0, 1)  # [C, H, W]
    p, m, t = s.patch_size, s.merge_size, s.temporal_patch_size
    gh, gw = h // p, w // p
    x = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # blocks, in-block, C, P, P
    x = np.broadcast_to(x[:, :, :, :, :, None], x.shape[:5] + (t,) + x.shape[5:])
    return np.ascontiguousarray(x.reshape(gh * gw, 3 * t * p * p)), (1, gh, gw)


def image_batch(images: list, s: ImageSettings) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """(pixel_values [N, C*T*P*P], grids) of images in order, as the processor concatenates them."""
    parts = [patches(image, s) for image in images]
    return np.concatenate([p for p, _ in parts]), [g for _, g in parts]
