"""A GGUF's architecture metadata -> the Hugging Face config.json transformers derives from
it, and its tensor names -> HF names, so the families of models/families/ build and load it.

The config is what transformers' `from_pretrained(..., gguf_file=)` builds (its legacy GGUF
path, which Llama, Qwen2 and Qwen3 files take): the keys it maps, the class defaults for the
rest. Keys that would change the math and that neither side reads (llama.cpp's rope
scaling, expert counts) are refused by name rather than dropped.
"""

from __future__ import annotations

import re

from jaxfill.models.config import ConfigError
from jaxfill.models.gguf.int_codes import quantization_config
from jaxfill.models.gguf.reader import GGUFHeader

# general.architecture -> the HF architecture it loads as.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# "{arch}." metadata key -> config.json key (transformers' mapping; head_dim per arch below).
KEYS = {
    "context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta", "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
# Where transformers reads head_dim: Llama from the rope width; Qwen2 derives it
# (hidden / heads); Qwen3 keeps its config class's default, 128, whatever the file says.
HEAD_DIM_KEY = {"llama": "rope.dimension_count", "qwen2": None, "qwen3": None}
QWEN3_HEAD_DIM = 128
# "{arch}." keys that change the math and are not read: refused when present.
REFUSED = ("rope.scaling.type", "rope.scaling.factor", "expert_count", "attention.sliding_window",
           "attention.key_length_swa")
TOKEN_IDS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "padding_token_id": "pad_token_id"}
# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
TOP_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_config(header: GGUFHeader) -> dict:
    """The config.json transformers builds for this file."""
    meta, arch = header.metadata, header.architecture
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{header.path}: GGUF architecture {arch!r} is not supported; "
                          f"supported: {', '.join(ARCHITECTURES)}")
    refused = [f"{arch}.{key}" for key in REFUSED if f"{arch}.{key}" in meta]
    if refused or "rope_freqs.weight" in header.tensors:
        raise ConfigError(f"{header.path}: GGUF {', '.join(refused) or 'rope_freqs.weight (Llama 3 rope)'} "
                          "is not supported (transformers' GGUF loader ignores it too)")
    config = {"architectures": [ARCHITECTURES[arch]], "model_type": arch}
    config.update({hf: meta[f"{arch}.{key}"] for key, hf in KEYS.items() if f"{arch}.{key}" in meta})
    head_key = HEAD_DIM_KEY[arch]
    if head_key and f"{arch}.{head_key}" in meta:
        config["head_dim"] = meta[f"{arch}.{head_key}"]
    if arch == "qwen3":
        config["head_dim"] = QWEN3_HEAD_DIM
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in meta:
        config["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    config.update({hf: meta[f"tokenizer.ggml.{key}"] for key, hf in TOKEN_IDS.items()
                   if f"tokenizer.ggml.{key}" in meta})
    config["tie_word_embeddings"] = "output.weight" not in header.tensors
    config["_name_or_path"] = meta.get("general.name", "")
    config["dtype"] = "float32" if meta.get("general.file_type", 0) == 0 else "bfloat16"
    quant = quantization_config(header.tensors)  # quantized projections stay packed
    if quant:
        config["quantization_config"] = quant
    return config


def hf_name(name: str) -> str:
    """GGUF tensor name -> HF's; an unknown one is a ConfigError naming it."""
    match = LAYER_NAME.match(name)
    if match and match.group(2) in LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{LAYER_TENSORS[match.group(2)]}.{match.group(3)}"
    base, _, suffix = name.rpartition(".")
    if base in TOP_TENSORS:
        return f"{TOP_TENSORS[base]}.{suffix}"
    raise ConfigError(f"GGUF tensor {name!r} has no Hugging Face counterpart jaxfill knows")


def row_order(name: str, config: dict, rows: int):
    """llama.cpp stores a Llama's q and k rows permuted for its rope (per head, the two
    halves interleaved); the HF row i is stored row order[i]. None: stored as HF has it."""
    if config["model_type"] != "llama" or not re.search(r"\.attn_[qk]\.", name):
        return None
    import numpy as np

    heads = config["num_attention_heads"] if ".attn_q." in name else config.get("num_key_value_heads")
    heads = heads or config["num_attention_heads"]
    half = rows // heads // 2
    # stored [head, half, 2] <- HF [head, 2, half]: HF row (h, j, i) is stored row (h, i, j)
    return np.arange(rows).reshape(heads, half, 2).transpose(0, 2, 1).reshape(rows)
