"""Tiny GGUF files for tests/test_gguf.py, written with the reference writer (gguf.GGUFWriter).

Each tensor takes the ggml type the test picks: the types gguf's own quantizer makes (Q8_0,
Q4_0, Q4_1, F16, BF16, F32) are quantized from random weights; the k-quants (Q4_K, Q5_K,
Q6_K), which it only reads, are random blocks whose f16 scales are set small. Llama's q
and k rows are permuted as llama.cpp's converter permutes them, so both loaders must undo it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the reference GGUF reader/writer (the test extra)")

# byte offset and size of each k-quant's f16 scales within its block: d, then dmin at the
# mean q times d, so the values d * scale * q - dmin * min centre on zero
K_SCALES = {"Q4_K": ((0, 2e-4), (2, 7.5 * 2e-4)), "Q5_K": ((0, 1e-4), (2, 15.5 * 1e-4)), "Q6_K": ((208, 2e-5),)}
SMALL = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, vocab=512)
# ggml type per tensor: between them the three files hold every supported type
TYPES = {
    "llama": dict(token_embd="Q8_0", attn_q="Q4_K", attn_k="Q5_K", attn_v="Q6_K", attn_output="Q4_0",
                  ffn_gate="Q4_1", ffn_up="BF16", ffn_down="F16", output="Q6_K"),
    "qwen2": dict(token_embd="Q4_0", attn_q="Q8_0", attn_k="Q4_0", attn_v="Q4_1", attn_output="Q5_K",
                  ffn_gate="Q6_K", ffn_up="F16", ffn_down="BF16"),
    "qwen3": dict(token_embd="Q6_K", attn_q="Q5_K", attn_k="Q4_K", attn_v="Q8_0", attn_output="Q4_1",
                  ffn_gate="Q4_0", ffn_up="Q5_K", ffn_down="Q4_K", output="F32"),
}


def random_blocks(rng, kind: str, rows: int, values: int) -> np.ndarray:
    """[rows, row bytes] of random blocks of a quantized type, scales set to sane magnitudes."""
    qtype = gguf.GGMLQuantizationType[kind]
    per_block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows * values // per_block, nbytes), dtype=np.uint8)
    for offset, scale in K_SCALES.get(kind, ((0, 1e-2),)):
        data[:, offset:offset + 2] = (scale * (0.5 + rng.random((len(data), 1)))).astype(np.float16).view(np.uint8)
    return data.reshape(rows, -1)


def encode(rng, kind: str, values: np.ndarray):
    """(array for GGUFWriter.add_tensor, raw_dtype) of float `values` [rows, in] as `kind`."""
    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        return values.astype(np.float32), None
    if kind in K_SCALES:
        return random_blocks(rng, kind, values.shape[0], values.shape[-1]), qtype
    return gguf.quants.quantize(values.astype(np.float32), qtype), qtype


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: per head, HF rows [2, half] stored as [half, 2]."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(directory: str, arch: str, seed: int = 0, projections: str | None = None, every: str | None = None,
               sizes: dict | None = None, tied: bool | None = None, **meta) -> str:
    """A random `arch` model ("llama", "qwen2", "qwen3") as `directory`/model.gguf; every
    projection in the type `projections` names, if given (a file int_group keeps packed);
    every tensor in type `every` (F32: a source for llama.cpp's quantizer); `sizes` over
    SMALL's; `tied`: no output.weight (default: as TYPES has it)."""
    rng = np.random.default_rng(seed)
    s, types = {**SMALL, **(sizes or {})}, dict(TYPES[arch])
    if tied is not None:
        types.pop("output", None)
        types.update({} if tied else {"output": "F32"})
    if projections:
        types.update({k: projections for k in types if k.startswith(("attn_", "ffn_"))})
    if every:
        types = {k: every for k in types}
    head_dim = 128 if arch == "qwen3" else s["hidden"] // s["heads"]  # transformers' Qwen3 reads no head_dim
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "model.gguf")
    w = gguf.GGUFWriter(path, arch)
    w.add_uint32("general.file_type", 7)
    w.add_string("general.name", f"tiny {arch}")
    for key, value in (("block_count", s["layers"]), ("context_length", 1024), ("embedding_length", s["hidden"]),
                       ("feed_forward_length", s["intermediate"]), ("attention.head_count", s["heads"]),
                       ("attention.head_count_kv", s["kv_heads"]), ("vocab_size", s["vocab"]),
                       ("rope.dimension_count", head_dim)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", 50000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    for key, value in meta.items():
        w.add_uint32(key, value)

    def add(name, kind, shape, scale=0.08, permute_heads=None):
        values = scale * rng.standard_normal(shape)
        data, raw = encode(rng, kind, values)
        if permute_heads:  # permute the stored rows (whole rows of blocks): as the converter does
            data = llama_permute(data, permute_heads)
        w.add_tensor(name, data, raw_dtype=raw)

    def norm(name, size):
        w.add_tensor(name, (1 + 0.2 * rng.standard_normal(size)).astype(np.float32))

    q_rows, kv_rows, hidden = s["heads"] * head_dim, s["kv_heads"] * head_dim, s["hidden"]
    add("token_embd.weight", types["token_embd"], (s["vocab"], hidden), scale=0.05)
    for i in range(s["layers"]):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", hidden)
        norm(p + "ffn_norm.weight", hidden)
        llama = arch == "llama"
        add(p + "attn_q.weight", types["attn_q"], (q_rows, hidden), permute_heads=s["heads"] if llama else None)
        add(p + "attn_k.weight", types["attn_k"], (kv_rows, hidden), permute_heads=s["kv_heads"] if llama else None)
        add(p + "attn_v.weight", types["attn_v"], (kv_rows, hidden))
        add(p + "attn_output.weight", types["attn_output"], (hidden, q_rows))
        add(p + "ffn_gate.weight", types["ffn_gate"], (s["intermediate"], hidden))
        add(p + "ffn_up.weight", types["ffn_up"], (s["intermediate"], hidden))
        add(p + "ffn_down.weight", types["ffn_down"], (hidden, s["intermediate"]))
        if arch == "qwen2":  # q, k, v biases
            for part, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                w.add_tensor(f"{p}attn_{part}.bias", (0.3 * rng.standard_normal(rows)).astype(np.float32))
        if arch == "qwen3":  # per-head RMSNorm of q and k
            norm(p + "attn_q_norm.weight", head_dim)
            norm(p + "attn_k_norm.weight", head_dim)
    norm("output_norm.weight", hidden)
    if "output" in types:
        add("output.weight", types["output"], (s["vocab"], hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
