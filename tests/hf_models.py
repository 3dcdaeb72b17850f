"""Random-init Hugging Face checkpoints for parity tests (written with save_pretrained)."""

from __future__ import annotations

import os

import torch

HF_SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                rms_norm_eps=1e-5, initializer_range=0.1)


def make_hf_checkpoint(directory: str, arch: str, dtype: torch.dtype = torch.float32, seed: int = 0,
                       **overrides) -> str:
    """Saves a random-init model of `arch` ("llama", "mistral", "qwen2") and returns its dir."""
    import transformers as tf

    kw = dict(HF_SMALL, **overrides)
    if arch == "llama":
        kw.setdefault("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        kw.setdefault("rope_theta", 500000.0)
        cfg, cls = tf.LlamaConfig(**kw), tf.LlamaForCausalLM
    elif arch == "mistral":
        kw.setdefault("sliding_window", 24)
        cfg, cls = tf.MistralConfig(**kw), tf.MistralForCausalLM
    elif arch == "qwen2":
        kw.setdefault("tie_word_embeddings", True)
        cfg, cls = tf.Qwen2Config(**kw), tf.Qwen2ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).to(dtype).eval()
    with torch.no_grad():  # HF inits norms to ones and biases to zero: randomise them
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def load_hf(directory: str, dtype: torch.dtype = torch.float32):
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="eager")
    return model.eval()
