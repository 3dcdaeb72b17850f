"""A random-init tiny Gemma4ForConditionalGeneration (3 text layers: full, sliding with a
24-token window, full; the full ones of their own head dim, the first one's image rows
feeding later layers, so their causal mask shows; a 2-layer vision tower over 2 x 2 patches
pooled 2 x 2, at most 70 soft tokens an image, with clipped linears and standardization on)
and its Gemma4ImageProcessorPil config, written with save_pretrained. Every norm, the clip
bounds, the standardization and the embedder are randomized so a dropped one shows.
`causal_copy` is the same weights with use_bidirectional_attention off (image rows causal)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from vision_gemma3 import _tokenizer

torch = pytest.importorskip("torch", reason="the Hugging Face reference needs torch (the test extra)")

BOI, EOI, IMAGE = 300, 301, 302
MAX_SOFT = 70
TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=24, hidden_size_per_layer_input=0,
            layer_types=["full_attention", "sliding_attention", "full_attention"], use_bidirectional_attention="vision",
            final_logit_softcapping=30.0,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e3},
                             "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                                "rope_theta": 1e4}})
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, patch_size=2, pooling_kernel_size=2, position_embedding_size=64, use_clipped_linears=True,
              standardize=True)


def tiny_gemma4_vl(directory: str, **text) -> str:
    """`text`: overrides of the text config (the "E" shape's per-layer inputs)."""
    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.Gemma4Config(text_config=dict(TEXT, **text), vision_config=VISION, audio_config=None, boi_token_id=BOI,
                          eoi_token_id=EOI, image_token_id=IMAGE, video_token_id=303, initializer_range=0.1)
    model = tf.Gemma4ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if "embedding_projection" in name:
                p.normal_(0.0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith(("input_min", "output_min")):
                b.fill_(-0.3 - 0.2 * torch.rand(()).item())
            if name.endswith(("input_max", "output_max")):
                b.fill_(0.3 + 0.2 * torch.rand(()).item())
            if name.endswith("std_bias"):
                b.copy_(0.5 * torch.randn_like(b))
            if name.endswith("std_scale"):
                b.copy_(0.5 + torch.rand_like(b))
    model.save_pretrained(directory)
    tf.Gemma4ImageProcessorPil(patch_size=2, pooling_kernel_size=2, max_soft_tokens=MAX_SOFT).save_pretrained(directory)
    _tokenizer(directory)
    return directory


def causal_copy(directory: str, target: str) -> str:
    """The same checkpoint with image rows attended causally (use_bidirectional_attention off)."""
    if not os.path.exists(os.path.join(target, "config.json")):
        shutil.copytree(directory, target, dirs_exist_ok=True)
        with open(os.path.join(target, "config.json")) as f:
            cfg = json.load(f)
        cfg["text_config"]["use_bidirectional_attention"] = None
        with open(os.path.join(target, "config.json"), "w") as f:
            json.dump(cfg, f)
    return target


def hf_gemma4_vl(directory: str):
    from transformers import Gemma4ForConditionalGeneration
    return Gemma4ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
