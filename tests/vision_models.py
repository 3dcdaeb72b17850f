"""A random-init tiny Qwen3VLForConditionalGeneration (2 text layers, a 3-block vision tower
with DeepStack after blocks 0 and 1, so the second add lands on the last layer's pruned rows)
and its image processor's preprocessor_config.json (patch 8, merge 2, at most 128 x 128
pixels), written with save_pretrained."""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch", reason="the Hugging Face reference needs torch (the test extra)")

IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 500, 501, 502, 503
TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-5,
            initializer_range=0.4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "mrope_section": [4, 2, 2], "mrope_interleaved": True})
# patch 8, merge 2: a 448 x 448 image is a 56 x 56 patch grid, 784 tokens after merging
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=8,
              temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_position_embeddings=64,
              deepstack_visual_indexes=[0, 1], initializer_range=0.2)


def tiny_qwen3_vl(directory: str) -> str:
    """Write the checkpoint into `directory` (if not there yet); returns it."""
    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    torch.manual_seed(0)
    config = Qwen3VLConfig(text_config=TEXT, vision_config=VISION, image_token_id=IMAGE_TOKEN,
                           video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
                           vision_end_token_id=VISION_END, tie_word_embeddings=False)
    model = Qwen3VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # biases and norms away from their 0 / 1 init, so a dropped one shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(directory)
    from transformers import Qwen2VLImageProcessorPil
    Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                             image_std=[0.5] * 3, size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128},
                             ).save_pretrained(directory)
    return directory


def hf_model(directory: str):
    from transformers import Qwen3VLForConditionalGeneration
    return Qwen3VLForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()


def config_json(directory: str) -> dict:
    with open(os.path.join(directory, "config.json")) as f:
        return json.load(f)
