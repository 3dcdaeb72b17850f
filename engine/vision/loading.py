"""The vision tower of a checkpoint that has one (its config.json's vision_config), else None."""

from __future__ import annotations

import json
import os

from jaxfill.engine.vision.image_processor import image_settings
from jaxfill.engine.vision.tower import VisionTower
from jaxfill.models.vision.config import vision_config
from jaxfill.models.vision.weights import load_encoder

# the towers models/vision/ builds (Qwen3.5's is Qwen3-VL's without DeepStack)
VISION_ARCHITECTURES = ("Qwen3VLForConditionalGeneration", "Qwen3_5ForConditionalGeneration")


def checkpoint_json(config) -> dict:
    if not config.model_path:
        return {}
    path = os.path.join(config.model_path, "config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def build_vision(config) -> VisionTower | None:
    """The tower, in f32 (small beside the decoder; transformers' reference runs it so too)."""
    if config.model.architecture not in VISION_ARCHITECTURES:
        return None
    hf = checkpoint_json(config)
    if "vision_config" not in hf:
        return None
    cfg = vision_config(hf)
    encoder = load_encoder(config.model_path, cfg)
    return VisionTower(encoder, image_settings(config.model_path, hf["vision_config"]), int(hf["image_token_id"]))
