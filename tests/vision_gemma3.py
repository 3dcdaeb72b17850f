"""A random-init tiny Gemma3ForConditionalGeneration (2 text layers: one sliding with a
24-token window, one full; a 2-layer SigLIP over 32 x 32 images in 4 x 4 patches, pooled
2 x 2 to 16 tokens) and its Gemma3ImageProcessor config, written with save_pretrained.
The projector's weight (zeros at init) and every norm and bias are randomized so a dropped
one shows."""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch", reason="the Hugging Face reference needs torch (the test extra)")

IMAGE, BOI, EOI = 302, 300, 301
MM_TOKENS = 16
TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=24,
            layer_types=["sliding_attention", "full_attention"], max_position_embeddings=1024, rms_norm_eps=1e-5,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                             "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}})
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
              patch_size=4)


def tiny_gemma3_vl(directory: str) -> str:
    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=MM_TOKENS,
                          image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI, initializer_range=0.1)
    model = tf.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if "mm_input_projection" in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    tf.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(directory)
    _tokenizer(directory)
    return directory


def _tokenizer(directory: str) -> None:
    """configs/tiny's byte-level tokenizer with Gemma 3's image tokens at the checkpoint's
    ids (special, so tokenization splits at them), no BOS."""
    tiny = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny", "tokenizer.json")
    with open(tiny) as f:
        tok = json.load(f)
    names = {BOI: "<start_of_image>", EOI: "<end_of_image>", IMAGE: "<image_soft_token>"}
    tok["added_tokens"] = [dict(t, content=names.get(t["id"], t["content"])) for t in tok["added_tokens"]
                           if t["id"] < 320]
    tok["post_processor"] = None
    with open(os.path.join(directory, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
                   "extra_special_tokens": {"boi_token": names[BOI], "eoi_token": names[EOI],
                                            "image_token": names[IMAGE]}}, f)


def hf_processor(directory: str):
    import transformers as tf
    return tf.Gemma3Processor(image_processor=tf.Gemma3ImageProcessorPil.from_pretrained(directory),
                              tokenizer=tf.AutoTokenizer.from_pretrained(directory), image_seq_length=MM_TOKENS)


def hf_gemma3_vl(directory: str):
    from transformers import Gemma3ForConditionalGeneration
    return Gemma3ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
