"""Pixels for Gemma 3's SigLIP, as transformers' Gemma3ImageProcessor (its PIL backend)
makes them with pan-and-scan off: every image resized to image_size x image_size (PIL
bilinear on uint8, aspect not kept), rescaled by 1/255 in f64 then f32, normalized in f32,
channels first. Pan-and-scan (extra crops of wide images) is not built: a checkpoint whose
preprocessor_config.json turns it on is refused by name."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from jaxfill.engine.vision.image_processor import to_rgb

BILINEAR = 2  # PIL.Image.Resampling.BILINEAR


@dataclasses.dataclass(frozen=True)
class Gemma3ImageSettings:
    size: int = 896  # Gemma 3's image_size
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale: float = 1 / 255
    resample: int = BILINEAR


def gemma3_settings(model_dir: str, image_size: int = 896) -> Gemma3ImageSettings:
    """The checkpoint's preprocessor_config.json, else Gemma 3's defaults at `image_size`."""
    base = Gemma3ImageSettings(size=image_size)
    path = os.path.join(model_dir, "preprocessor_config.json")
    if not os.path.exists(path):
        return base
    with open(path) as f:
        p = json.load(f)
    if p.get("do_pan_and_scan"):
        raise ValueError(f"{path}: do_pan_and_scan=true is not supported (Gemma 3's pan-and-scan crops are not "
                         "built); set it false")
    for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        if p.get(key, True) is not True:
            raise ValueError(f"{path}: {key}={p[key]} is not supported (only Gemma 3's defaults are)")
    size = p.get("size") or {}
    h, w = size.get("height", image_size), size.get("width", image_size)
    if h != w or h != image_size:
        raise ValueError(f"{path}: size {h} x {w} is not the vision tower's image_size {image_size}")
    return dataclasses.replace(base, mean=tuple(p.get("image_mean", base.mean)), std=tuple(p.get("image_std", base.std)),
                               rescale=p.get("rescale_factor", base.rescale), resample=p.get("resample", base.resample))


def pixels(image, s: Gemma3ImageSettings) -> np.ndarray:
    """[3, size, size] f32 of one image (a PIL image or [H, W, 3] uint8)."""
    from PIL import Image
    rgb = to_rgb(image)
    if rgb.shape[:2] != (s.size, s.size):
        rgb = np.asarray(Image.fromarray(rgb).resize((s.size, s.size), resample=s.resample))
    x = (rgb.astype(np.float64) * s.rescale).astype(np.float32)
    return np.ascontiguousarray(((x - np.asarray(s.mean, np.float32)) / np.asarray(s.std, np.float32)).transpose(2, 0, 1))
