"""ggml's block formats -> float32, vectorised over blocks (numpy, no loops per block).

Each quantized row is a run of blocks; a block holds its scale(s) and packed integers
(ggml-common.h). The formats here are those of the common quantizations: Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1 (32 values a block; llama.cpp's k-quant mixes fall back to Q5_0 / Q5_1 / Q8_0 for
tensors whose rows are not whole 256-value super-blocks, e.g. a 576- or 896-wide model) and
the k-quants Q4_K, Q5_K, Q6_K (256 values a block, in 16- or 32-value groups with 6- or
8-bit scales), plus the plain F32, F16 and BF16. Every function takes [n_blocks,
block_bytes] uint8 and returns [n_blocks, block_values] float32; the arithmetic is ggml's
own (scale times integer, minus the minimum), in float32.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

QK_K = 256  # values in a k-quant super-block


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:  # [n, 1] f32 from bytes start:start+2
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[n, g, 32] bytes -> [n, 2g, 32]: per 32 bytes, the low nibbles (32 values), then the high."""
    n, g, w = packed.shape
    return np.stack([packed & 0x0F, packed >> 4], axis=2).reshape(n, 2 * g, w)


def q8_0(blocks: np.ndarray) -> np.ndarray:  # d f16, 32 x int8
    return _f16(blocks, 0) * blocks[:, 2:].view(np.int8).astype(np.float32)


def q4_0(blocks: np.ndarray) -> np.ndarray:  # d f16, 16 bytes: values 0..15 low nibbles, 16..31 high
    q = _nibbles(blocks[:, None, 2:18]).reshape(len(blocks), 32).astype(np.int8) - np.int8(8)
    return _f16(blocks, 0) * q.astype(np.float32)


def q4_1(blocks: np.ndarray) -> np.ndarray:  # d f16, m f16, 16 bytes of nibbles as Q4_0
    q = _nibbles(blocks[:, None, 4:20]).reshape(len(blocks), 32).astype(np.float32)
    return _f16(blocks, 0) * q + _f16(blocks, 2)


def fifth_bits(blocks: np.ndarray, start: int) -> np.ndarray:
    """Q5_0 / Q5_1: the 32-bit qh at `start` -> [n, 32] fifth bits, value j's in bit j."""
    qh = blocks[:, start:start + 4].copy().view("<u4")  # [n, 1]
    return ((qh >> np.arange(32, dtype=np.uint32)[None, :]) & 1).astype(np.uint8)


def q5_codes(blocks: np.ndarray, start: int) -> np.ndarray:
    """[n, 32] 5-bit codes of Q5_0 (start 2) / Q5_1 (start 4): nibbles as Q4_0's after qh."""
    low = _nibbles(blocks[:, None, start + 4:start + 20]).reshape(len(blocks), 32)
    return low | (fifth_bits(blocks, start) << 4)


def q5_0(blocks: np.ndarray) -> np.ndarray:  # d f16, qh u32, 16 bytes of nibbles: d * (q - 16)
    return _f16(blocks, 0) * (q5_codes(blocks, 2).astype(np.float32) - 16)


def q5_1(blocks: np.ndarray) -> np.ndarray:  # d f16, m f16, qh u32, 16 bytes of nibbles: d * q + m
    return _f16(blocks, 0) * q5_codes(blocks, 4).astype(np.float32) + _f16(blocks, 2)


def k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes -> 8 six-bit scales and 8 six-bit minimums (ggml's get_scale_min_k4):
    groups 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (minimums), groups 4-7 in
    the nibbles of bytes 8-11 with their top 2 bits in the top bits of bytes 0-7."""
    lo, hi, mix = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scale = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 6) << 4)], axis=1)
    minimum = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 6) << 4)], axis=1)
    return scale.astype(np.float32), minimum.astype(np.float32)


def _k_affine(blocks: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: value = d * scale[g] * q - dmin * min[g] over 8 groups of 32."""
    scale, minimum = k_scales(blocks[:, 4:16])
    d = (_f16(blocks, 0) * scale)[:, :, None]
    dm = (_f16(blocks, 2) * minimum)[:, :, None]
    return (d * q.astype(np.float32) - dm).reshape(len(blocks), QK_K)


def q4_k(blocks: np.ndarray) -> np.ndarray:  # d, dmin, 12 scale bytes, 128 bytes of nibbles
    return _k_affine(blocks, _nibbles(blocks[:, 16:144].reshape(-1, 4, 32)))


def q5_k_codes(blocks: np.ndarray) -> np.ndarray:  # [n, 8, 32] 5-bit codes: 32 bytes of 5th bits, 128 of nibbles
    low = _nibbles(blocks[:, 48:176].reshape(-1, 4, 32))  # [n, 8, 32]
    high = (blocks[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # group g: bit g
    return low | (high << 4)


def q5_k(blocks: np.ndarray) -> np.ndarray:  # d, dmin, 12 scale bytes, 32 bytes of 5th bits, 128 of nibbles
    return _k_affine(blocks, q5_k_codes(blocks))


def q6_codes(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] unsigned 6-bit codes of Q6_K: 128 bytes of low nibbles, 64 of 2-bit highs.
    Each half of 128 values: 64 low-nibble bytes give values 0-63 (low) and 64-127 (high),
    32 high bytes give 2 bits to each of the 4 runs of 32."""
    n = len(blocks)
    packed = blocks[:, :128].reshape(n, 2, 1, 64)
    low = np.concatenate([packed & 0x0F, packed >> 4], axis=2).reshape(n, 2, 4, 32)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    high = (blocks[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3
    return (low | (high << 4)).reshape(n, QK_K)


def q6_k(blocks: np.ndarray) -> np.ndarray:
    """6-bit codes (q6_codes), 16 int8 scales (one per 16 values), d: d * sc * (q - 32)."""
    n = len(blocks)
    q = (q6_codes(blocks).astype(np.int8) - np.int8(32)).reshape(n, 16, 16)
    d = _f16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)
    return (d[:, :, None] * q.astype(np.float32)).reshape(n, QK_K)


def _plain(dtype):
    return lambda blocks: blocks.copy().view(dtype).astype(np.float32)


# ggml type id -> (name, values a block, bytes a block, blocks -> values)
TYPES = {
    0: ("F32", 1, 4, _plain(np.float32)),
    1: ("F16", 1, 2, _plain(np.float16)),
    30: ("BF16", 1, 2, _plain(ml_dtypes.bfloat16)),
    8: ("Q8_0", 32, 34, q8_0),
    2: ("Q4_0", 32, 18, q4_0),
    3: ("Q4_1", 32, 20, q4_1),
    6: ("Q5_0", 32, 22, q5_0),
    7: ("Q5_1", 32, 24, q5_1),
    12: ("Q4_K", QK_K, 144, q4_k),
    13: ("Q5_K", QK_K, 176, q5_k),
    14: ("Q6_K", QK_K, 210, q6_k),
}
NAMES = {name: kind for kind, (name, *_rest) in TYPES.items()}


def row_bytes(ggml_type: int, values: int) -> int:
    _, per_block, nbytes, _ = TYPES[ggml_type]
    return values // per_block * nbytes


def dequantize_rows(data: np.ndarray, ggml_type: int, values: int) -> np.ndarray:
    """[rows, row_bytes] uint8 -> [rows, values] float32."""
    _, per_block, nbytes, fn = TYPES[ggml_type]
    rows = data.shape[0]
    return fn(np.ascontiguousarray(data).reshape(-1, nbytes)).reshape(rows, values)
