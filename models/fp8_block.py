"""FP8 block-scaled projection weights (`quant_method: fp8`, DeepSeek V3 / R1, Kimi K2,
Qwen3-FP8, MiniMax-M2), kept in FP8 on the device.

A checkpoint stores a Linear weight W [out, in] as `<name>.weight` in float8 (e4m3 or
e5m2) and `<name>.weight_scale_inv` f32 [ceil(out / B0), ceil(in / B1)], one scale per
B0 x B1 block (the last row and column of blocks may be partial):
W[o, i] = f32(fp8[o, i]) * scale_inv[o // B0, i // B1].

Our params are [stacked..., in..., parts..., out...] (models/quant.py's layouts; `parts`:
experts_gate_up's (gate, up) axis, two HF tensors blocked apart). Each param keeps the
stored fp8 values, and its `<name>_scale` param holds the HF scales in the same order,
one axis per group: [stacked..., ceil(in / B1), parts..., ceil(out / B0)], where in and
out are the group's axes flattened in C order, as the HF [out, in] tensor is. That lets
a head split (q [E, H, D] with D = 192 and B0 = 128) keep blocks that straddle heads.

A block size of 0 spans the whole axis: compressed-tensors' fp8 `channel` strategy is
(1, 0), one scale per output row, its `tensor` strategy (0, 0), one scale a tensor
(models/config/quantization.py); `sides` resolves it per param.

The matmul dequantizes the weight inside the jitted program (`dequantize`: fp8 -> f32
times the scales repeated over their blocks, one rounding to the compute dtype), which
XLA fuses into the operand of the dot: weight-only, the same numbers as transformers'
`dequantize=True` loader. A split over devices must keep whole blocks on each device
(`split_error`, refused by engine/validation.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

FORMATS = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}
SAFETENSORS = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
HF_SCALE = ".weight_scale_inv"
HF_ACTIVATION_SCALE = ".activation_scale"  # the static scheme's input scales: weight-only here, unused
# projection param -> (stacked leading axes, input axes, part axes); the rest are outputs
LAYOUTS = {"q": (0, 1, 0), "k": (0, 1, 0), "v": (0, 1, 0), "o": (0, 2, 0), "gate": (0, 1, 0), "up": (0, 1, 0),
           "down": (0, 1, 0), "experts_gate_up": (1, 1, 1), "experts_down": (1, 1, 0),
           # multi-head latent attention (models/mixers/mla.py)
           "q_a": (0, 1, 0), "q_b": (0, 1, 0), "kv_a": (0, 1, 0), "w_ukv": (0, 1, 0)}
META = "fp8_block"  # the scale param's metadata: (block, layout)


class Fp8Format(NamedTuple):
    """How a model keeps its projections in fp8 (ModelConfig.weight_form)."""
    dtype: str  # a key of FORMATS
    block: tuple[int, int]  # (B0 over outputs, B1 over inputs): quantization_config.weight_block_size


def is_fp8(dtype) -> bool:
    return np.dtype(dtype) in tuple(np.dtype(t) for t in FORMATS.values())


def groups(shape: tuple, layout: tuple) -> tuple[tuple, int, tuple, int]:
    """(stacked dims, flattened inputs, part dims, flattened outputs) of a param's shape."""
    s, n, p = layout
    return shape[:s], math.prod(shape[s:s + n]), shape[s + n:s + n + p], math.prod(shape[s + n + p:])


def sides(block: tuple, n_out: int, n_in: int) -> tuple[int, int]:
    """(B0, B1) of a param with n_out outputs and n_in inputs: a 0 is the whole axis."""
    return block[0] or max(n_out, 1), block[1] or max(n_in, 1)


def scale_shape(shape: tuple, layout: tuple, block: tuple) -> tuple:
    lead, n_in, parts, n_out = groups(shape, layout)
    b0, b1 = sides(block, n_out, n_in)
    return lead + (-(-n_in // b1),) + parts + (-(-n_out // b0),)


def scale_axes(axes: tuple, layout: tuple, block: tuple = (1, 1)) -> tuple:
    """The scales split like the first axis of each group (a whole block per device:
    `split_error`); a side whose one block spans the axis (size 0) is not split."""
    s, n, p = layout
    return axes[:s] + (axes[s] if block[1] else None,) + axes[s + n:s + n + p] + (
        axes[s + n + p] if block[0] else None,)


def _repeat(x, axis: int, block: int, size: int):  # each scale over its block, the edge block cut
    x = jnp.repeat(x, block, axis=axis) if isinstance(x, jax.Array) else np.repeat(x, block, axis=axis)
    return x if x.shape[axis] == size else x[(slice(None),) * (axis % x.ndim) + (slice(0, size),)]


def dequantize(w,  # [stacked..., in..., parts..., out...] float8 (numpy or jax)
               scale,  # scale_shape(w.shape) f32
               layout: tuple, block: tuple, dtype=np.float32):  # like w, in dtype
    """fp8 * its block's scale in f32, then one rounding to `dtype`."""
    lead, n_in, parts, n_out = groups(w.shape, layout)
    block = sides(block, n_out, n_in)
    flat = w.reshape(lead + (n_in,) + parts + (n_out,))
    s = scale.astype(np.float32)
    s = _repeat(_repeat(s, len(lead), block[1], n_in), -1, block[0], n_out)
    return (flat.astype(np.float32) * s).astype(dtype).reshape(w.shape)


def quantize(w,  # [stacked..., in..., parts..., out...] float (numpy or jax)
             layout: tuple, block: tuple, fp8=ml_dtypes.float8_e4m3fn):  # (fp8 like w, f32 scales)
    """Block amax / fp8 max as the scale (transformers' Fp8Quantize, edge blocks included):
    random init of an fp8 model, and tests' checkpoints."""
    xp = jnp if isinstance(w, jax.Array) else np
    lead, n_in, parts, n_out = groups(w.shape, layout)
    block = sides(block, n_out, n_in)
    bi, bo = -(-n_in // block[1]), -(-n_out // block[0])
    flat = w.astype(np.float32).reshape(lead + (n_in,) + parts + (n_out,))
    k = len(lead)
    pad = [(0, 0)] * flat.ndim
    pad[k], pad[-1] = (0, bi * block[1] - n_in), (0, bo * block[0] - n_out)
    tiles = xp.pad(flat, pad).reshape(lead + (bi, block[1]) + parts + (bo, block[0]))
    amax = xp.max(xp.abs(tiles), axis=(k + 1, tiles.ndim - 1))  # [stacked..., bi, parts..., bo]
    fp8_max = np.float32(ml_dtypes.finfo(fp8).max)
    scale = xp.where(amax > 0, amax / fp8_max, np.float32(1)).astype(np.float32)
    s = _repeat(_repeat(scale, k, block[1], n_in), -1, block[0], n_out)
    q = xp.clip(flat / s, -fp8_max, fp8_max).astype(fp8)
    return q.reshape(w.shape), scale


def dequantize_param(w, scale_param, dtype):
    """A projection param (jax) dequantized by the scale param that carries its block and layout."""
    block, layout = scale_param.get_metadata()[META]
    return dequantize(w, scale_param[...], layout, block, dtype)


def split_error(name: str, shape: tuple, axes: tuple, spec, sizes, block: tuple) -> str | None:
    """Why a device split `spec` (a PartitionSpec of the param `name` by its logical `axes`)
    cuts one of its blocks, or None. Only a group's first axis splits (models/sharding.py
    RULES): each device then holds dim / n of it times the rest of the group."""
    s, n, p = LAYOUTS[name]
    for start, stop, b in ((s, s + n, block[1]), (s + n + p, len(shape), block[0])):
        if not b:  # one scale over the whole axis: every device uses it whole
            continue
        for axis in range(start, stop):
            mesh_axes = spec[axis] if axis < len(spec) else None
            if not mesh_axes:
                continue
            split = sizes(mesh_axes)
            extent = shape[axis] // split * math.prod(shape[axis + 1:stop])
            if extent % b:
                side = "inputs" if start == s else "outputs"
                return (f"{name} {list(shape)} splits its {side} ('{axes[axis]}') {split} ways into "
                        f"{extent} per device, not a multiple of the {b}-wide fp8 block")
    return None


def _flat(box: tuple, shape: tuple) -> np.ndarray:  # C-order flat indices of a box of `shape`, ascending
    return np.arange(math.prod(shape), dtype=np.int64).reshape(shape)[tuple(slice(a, b) for a, b in box)].ravel()


class DequantizedSlices:
    """An fp8 HF weight seen in param layout, dequantized one box at a time (the interface
    of models.checkpoint.TensorSlices: `shape`, `read(index)`): a box reads only the rows
    and columns of the HF tensor it spans and the scales of their blocks. For the params
    not kept in fp8: model.weight_dtype auto (the model dtype), int8 (re-quantized from
    these f32 values, models/quant.py), and the linear layers' projections."""

    def __init__(self, weight,  # reader of the HF [out, in] fp8 tensor (its rows, for a fused one)
                 scales,  # reader of its [ceil(out / B0), ceil(in / B1)] f32 scales
                 stored_shape: tuple, perm: tuple,  # the param as a view of [out, in] (models.families.base.HFTensor)
                 num_out: int,  # stored_shape[:num_out] flatten to out, the rest to in
                 block: tuple, target):
        self.weight, self.scales, self.target = weight, scales, np.dtype(target)
        self.shape = tuple(stored_shape[p] for p in perm)
        self.num_in = len(stored_shape) - num_out
        self.block = sides(block, *weight.shape)

    def read(self, index: tuple = ()) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(self.shape) - len(tuple(index)))
        box = tuple((lambda s: (s[0], max(s[0], s[1])))(i.indices(d)) for i, d in zip(index, self.shape))
        lengths = [b - a for a, b in box]
        if 0 in lengths:
            return np.empty(lengths, self.target)
        m, (b0, b1) = self.num_in, self.block
        rows, cols = _flat(box[m:], self.shape[m:]), _flat(box[:m], self.shape[:m])
        o0, o1, i0, i1 = rows[0], rows[-1] + 1, cols[0], cols[-1] + 1
        w = self.weight.read((slice(o0, o1), slice(i0, i1))).astype(np.float32)
        s = self.scales.read((slice(o0 // b0, -(-o1 // b0)), slice(i0 // b1, -(-i1 // b1))))
        s = np.repeat(np.repeat(s, b0, axis=0), b1, axis=1)
        s = s[o0 % b0:o0 % b0 + o1 - o0, i0 % b1:i0 % b1 + i1 - i0]
        values = (w * s)[np.ix_(rows - o0, cols - i0)]  # [box outputs, box inputs]
        return np.ascontiguousarray(values.T.reshape(lengths), dtype=self.target)
