"""MXFP4 expert weights (the OCP microscaling format gpt-oss is published in), dequantized
at load a few experts at a time.

A tensor W [E, in, out] is stored as `<name>_blocks` [E, out, in / 32, 16] uint8, two
FP4 (E2M1) codes a byte, low nibble first, and `<name>_scales` [E, out, in / 32] uint8,
one power-of-two exponent (bias 127) per 32 inputs: W[e, i, o] = FP4[code] * 2^(scale - 127).
"""

from __future__ import annotations

import numpy as np

# The 16 E2M1 values by code: sign bit 3, then 2 exponent bits and 1 mantissa bit.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCK = 32  # inputs per scale
SUFFIXES = ("_blocks", "_scales")


def dequantize_mxfp4(blocks: np.ndarray,  # [..., out, in / 32, 16] uint8
                     scales: np.ndarray,  # [..., out, in / 32] uint8
                     ) -> np.ndarray:  # [..., in, out] f32
    lo = FP4_VALUES[blocks & 0x0F]
    hi = FP4_VALUES[blocks >> 4]
    values = np.stack([lo, hi], axis=-1).reshape(blocks.shape[:-1] + (BLOCK,))  # [..., out, G, 32]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    values = values.reshape(values.shape[:-2] + (-1,))  # [..., out, in]
    return np.swapaxes(values, -1, -2)


def packed_shapes(hf_shape: tuple) -> tuple[tuple, tuple]:
    """The blocks' and scales' shapes of an [E, in, out] tensor."""
    e, n_in, n_out = hf_shape
    if n_in % BLOCK:
        raise ValueError(f"an MXFP4 tensor's input axis ({n_in}) must be a multiple of {BLOCK}")
    return (e, n_out, n_in // BLOCK, BLOCK // 2), (e, n_out, n_in // BLOCK)


class Mxfp4Slices:
    """An [E, in, out] MXFP4 tensor seen in param layout (the HF tensor reshaped to
    `stored_shape` and transposed by `perm`, experts first in both), read one box at a
    time: a box dequantizes only the experts it covers. The interface of
    models.checkpoint.TensorSlices: `shape` and `read(index)`."""

    def __init__(self, blocks, scales,  # TensorSlices of the two stored uint8 tensors
                 stored_shape: tuple, perm: tuple, target: np.dtype):
        if perm[0] != 0:
            raise ValueError("an MXFP4 param must keep the experts as its first axis")
        self.blocks, self.scales = blocks, scales
        self.stored_shape, self.perm, self.target = tuple(stored_shape), tuple(perm), np.dtype(target)
        self.shape = tuple(self.stored_shape[p] for p in self.perm)

    def read(self, index: tuple = ()) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(self.shape) - len(tuple(index)))
        experts = index[0]
        w = dequantize_mxfp4(self.blocks.read((experts,)), self.scales.read((experts,)))  # [e, in, out]
        w = w.reshape((w.shape[0],) + self.stored_shape[1:]).transpose(self.perm)
        return np.ascontiguousarray(w[(slice(None),) + index[1:]], dtype=self.target)
