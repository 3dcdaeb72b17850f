"""The vision tower of a checkpoint that has one (its config.json's vision_config), else None."""

from __future__ import annotations

import json
import os

from jaxfill.engine.capabilities.table import IMAGES_BIDIRECTIONAL, model_kinds, refusals
from jaxfill.engine.validation import describe
from jaxfill.engine.vision.gemma3_images import gemma3_settings
from jaxfill.engine.vision.gemma3_tower import Gemma3Tower
from jaxfill.engine.vision.gemma4_images import gemma4_settings
from jaxfill.engine.vision.gemma4_tower import Gemma4Tower
from jaxfill.engine.vision.image_processor import image_settings
from jaxfill.engine.vision.tower import VisionTower
from jaxfill.models.vision.config import vision_config
from jaxfill.models.vision.gemma4_vision import gemma4_vision_config
from jaxfill.models.vision.gemma4_weights import load_gemma4_vision
from jaxfill.models.vision.siglip import siglip_config
from jaxfill.models.vision.siglip_weights import load_siglip
from jaxfill.models.vision.weights import load_encoder

# the towers models/vision/ builds (Qwen3.5's is Qwen3-VL's without DeepStack, the MoE classes'
# their dense sibling's; Gemma 3's is SigLIP; Gemma 4's its own, models/vision/gemma4_vision.py)
QWEN_ARCHITECTURES = ("Qwen3VLForConditionalGeneration", "Qwen3_5ForConditionalGeneration",
                      "Qwen3VLMoeForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
VISION_ARCHITECTURES = QWEN_ARCHITECTURES + ("Gemma3ForConditionalGeneration", "Gemma4ForConditionalGeneration")


def checkpoint_json(config) -> dict:
    if not config.model_path:
        return {}
    path = os.path.join(config.model_path, "config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def build_vision(config) -> VisionTower | None:
    """The tower, in f32 (small beside the decoder; transformers' reference runs it so too).
    None for a Qwen image-text checkpoint loaded with `model.mrope_section = []`: its text
    tower alone, on the plain rope (images would need the (t, h, w) one)."""
    if config.model.architecture not in VISION_ARCHITECTURES:
        return None
    if config.model.architecture in QWEN_ARCHITECTURES and not config.model.attention.mrope_section:
        return None
    hf = checkpoint_json(config)
    if not hf.get("vision_config"):
        return None
    if config.model.architecture == "Gemma3ForConditionalGeneration":
        return build_gemma3(config, hf)
    if config.model.architecture == "Gemma4ForConditionalGeneration":
        return build_gemma4(config, hf)
    cfg = vision_config(hf)
    encoder = load_encoder(config.model_path, cfg)
    return VisionTower(encoder, image_settings(config.model_path, hf["vision_config"]), int(hf["image_token_id"]))


def build_gemma3(config, hf: dict) -> Gemma3Tower:
    """SigLIP and the projector; refused where an image could never be scheduled whole (its
    rows attend each other both ways, so a prefill chunk holds all of them)."""
    cfg = siglip_config(hf)
    room = step_room(config)
    if room < cfg.mm_tokens_per_image:
        raise ValueError(f"engine.max_num_batched_tokens / long_prefill_token_threshold ({room}) must hold one "
                         f"Gemma 3 image's {cfg.mm_tokens_per_image} rows: an image is prefilled in one chunk")
    get = lambda *keys: next(int(hf[k]) for k in keys if k in hf)  # noqa: E731
    return Gemma3Tower(load_siglip(config.model_path, cfg), gemma3_settings(config.model_path, cfg.image_size),
                       get("boi_token_id", "boi_token_index"), get("image_token_id", "image_token_index"),
                       get("eoi_token_id", "eoi_token_index"), refused=images_refused(config),
                       boi_text=boi_text(config.model_path))


def step_room(config) -> int:  # the most new rows one sequence's prefill chunk may take
    e = config.engine
    return min(e.max_num_batched_tokens, e.long_prefill_token_threshold or e.max_num_batched_tokens)


def build_gemma4(config, hf: dict) -> Gemma4Tower:
    """Gemma 4's tower and embedder; with image rows attended both ways (the text config's
    use_bidirectional_attention="vision") refused where the largest image could never be
    scheduled whole."""
    text = hf.get("text_config") or {}
    settings = gemma4_settings(config.model_path, hf["vision_config"])
    bidirectional = text.get("use_bidirectional_attention") == "vision"
    if bidirectional and step_room(config) < settings.max_soft_tokens:
        raise ValueError(f"engine.max_num_batched_tokens / long_prefill_token_threshold ({step_room(config)}) must "
                         f"hold one Gemma 4 image's up to {settings.max_soft_tokens} rows (max_soft_tokens): an "
                         "image is prefilled in one chunk")
    cfg = gemma4_vision_config(hf, settings.max_soft_tokens)
    return Gemma4Tower(load_gemma4_vision(config.model_path, cfg), settings, int(hf.get("boi_token_id", 255_999)),
                       int(hf.get("image_token_id", 258_880)), int(hf.get("eoi_token_id", 258_882)), bidirectional,
                       int(text.get("pad_token_id", 0) or 0), refused=images_refused(config))


def boi_text(model_dir: str) -> str:
    """The tokenizer's `<start_of_image>` (tokenizer_config.json's boi_token), else Gemma 3's."""
    path = os.path.join(model_dir, "tokenizer_config.json")
    if not os.path.exists(path):
        return "<start_of_image>"
    with open(path) as f:
        t = json.load(f)
    return t.get("boi_token") or (t.get("extra_special_tokens") or {}).get("boi_token") or "<start_of_image>"


def images_refused(config) -> str | None:
    """Why this engine refuses a request with Gemma 3 or Gemma 4 images (the capability table's
    images=bidirectional rules, in validation's one line), None: it takes them. Text-only
    requests run as for any Gemma 3 or 4."""
    broken = refusals(config, model_kinds(config.model), frozenset({IMAGES_BIDIRECTIONAL}))
    return describe(broken[0], config) if broken else None
