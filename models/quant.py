"""Symmetric per-output-channel int8 weights (w8a16).

A projection weight W [in..., out...] is stored as int8 Q with one f32 scale per output
channel: scale = max|W| over the input axes * f32(1/127), Q = round(W * (1/scale)), so
|W - Q * scale| <= scale / 2 per element, plus f32 rounding (tests/test_weight_quant.py
states the exact bound). The matmul
runs in the compute dtype on Q cast inside the jitted program, and the scale multiplies
the result: (x @ Q) * scale == x @ (Q * scale), with no dequantized copy of W kept.

What is quantized is what the model builds as int8 (models/layers.py `projection`, the
mixers' `int8_form`): attention's and the MLPs' projections, the experts', MLA's (q, the
latent's kv_a and its up-projection w_ukv, o, Ling's head gate), the sparse-attention
indexer's q and k, and the linear mixers' input and output projections. The loader and
`quantize_model` follow the model's own dtypes, so no list of names has to agree with it.
The embedding, the LM head, norms, biases, the linear mixers' depthwise convolutions and
the f32 indexer weights stay in the model dtype, as vLLM does by default: the head's
errors go straight into the logits, a gather reads only a few rows anyway, and a
convolution holds a few values per channel.

Scales are per output channel, so a slice of columns (what tensor parallelism gives
q/k/v/gate/up) quantizes on its own. A slice of rows (o, down under tensor parallelism)
does not: its scales need every row, and `QuantizedSlices` finds them by streaming the
rest of the tensor in bounded chunks, so loading still holds about one slice at a time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxfill.models.fp8_block as fp8_block
import jaxfill.models.int_group as int_group

QMAX = 127
# attention's, the MLPs' and the experts' projections -> their input axes (input_axes' answer)
QUANTIZED_INPUT_AXES = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1,
                        "experts_gate_up": 1, "experts_down": 1}
# projections back into the residual stream: every axis but the last (embed) is an input
OUTPUT_PROJECTIONS = ("o", "out", "down", "experts_down")
# projections stacked over experts: how many leading axes stack them ([E, in, out...]);
# each expert is quantized on its own (scales [E, out...])
STACKED_AXES = {"experts_gate_up": 1, "experts_down": 1}
SCALE_SUFFIX = "_scale"
CHUNK_ELEMENTS = 1 << 22  # rows streamed at a time when a slice's scales need the whole column


def input_axes(name: str, ndim: int, stacked: int = 0) -> int:
    """How many axes of projection `name` [stacked..., in..., out...] (`ndim` in all) its
    matmul contracts, the axes its per-output-channel scale is taken over: an output
    projection's all but the last (o [H, D, E], out [H, P, E], down [I, E]); an input
    projection's first (q [E, H, D], w_ukv [lat, H, nope + vd], qkvz [E, Hk, W])."""
    return ndim - stacked - 1 if name in OUTPUT_PROJECTIONS else 1


def is_int8(dtype) -> bool:
    """Whether a param of this dtype is an int8 projection (it has a `_scale` beside it)."""
    return np.dtype(dtype) == np.dtype(np.int8)


def scale_path(path: tuple) -> tuple:
    return tuple(path[:-1]) + (path[-1] + SCALE_SUFFIX,)


def scales_from_amax(amax):  # [out...] f32 -> [out...] f32
    # A product, not amax / 127: XLA rewrites division by a constant into this product,
    # and numpy (loading) and XLA (random init under jit) must give the same bits.
    return (amax * np.float32(1 / QMAX)).astype(np.float32)


def quantize_with(w,  # [in..., out...] float
                  scale,  # [out...] f32
                  ):  # [in..., out...] int8
    """Q = round(W * (1 / scale)) (half to even); channels of zeros give 0. The reciprocal
    is explicit because XLA turns a division by a broadcast into it: written this way
    numpy and XLA give the same bits."""
    xp = jnp if isinstance(w, jax.Array) or isinstance(scale, jax.Array) else np
    inv = np.float32(1) / xp.where(scale > 0, scale, np.float32(1))
    return xp.clip(xp.rint(w.astype(np.float32) * inv), -QMAX, QMAX).astype(np.int8)


def quantize(w,  # [stacked..., in..., out...] float, numpy or jax
             num_in: int,
             stacked: int = 0,
             ):  # (int8 like w, f32 [stacked..., out...])
    xp = jnp if isinstance(w, jax.Array) else np
    inputs = tuple(range(stacked, stacked + num_in))
    scale = scales_from_amax(xp.max(xp.abs(w.astype(np.float32)), axis=inputs))
    return quantize_with(w, xp.expand_dims(scale, inputs) if stacked else scale), scale


def quantize_param(name: str, w):  # (int8 like w, f32 scales)
    """`quantize` with the input and stacked axes of the projection called `name`."""
    stacked = STACKED_AXES.get(name, 0)
    return quantize(w, input_axes(name, w.ndim, stacked), stacked)


def dequantize(q,  # [in..., out...] int8
               scale,  # [out...] f32
               dtype=np.float32):  # [in..., out...]
    return (q.astype(np.float32) * scale).astype(dtype)


def qeinsum(eq: str, x: jax.Array, w: jax.Array, scale) -> jax.Array:
    """einsum(eq, x, w) for a plain, int8 or fp8 block-scaled weight. int8: w is cast to x's
    dtype inside the jitted program and the per-output-channel scale multiplies the result
    (in f32, one rounding back to x's dtype); output channels must be the result's trailing
    axes. fp8: w dequantized by its block scales first (models/fp8_block.py); int_group:
    the packed codes by their group scales and zeros (models/int_group.py)."""
    if scale is None:  # scale: None, the f32 scales (an array or an nnx.Param), or IntGroupScales
        return jnp.einsum(eq, x, w)
    if isinstance(scale, int_group.IntGroupScales):
        return jnp.einsum(eq, x, scale.dequantize(w, x.dtype))
    if fp8_block.is_fp8(w.dtype):  # scale: the nnx.Param, which carries the block layout
        return jnp.einsum(eq, x, fp8_block.dequantize_param(w, scale, x.dtype))
    y = jnp.einsum(eq, x, w.astype(x.dtype))
    return (y * scale[...]).astype(x.dtype)


def param_bytes(state) -> int:
    """Bytes of every array in a params pytree (global shapes, not per device)."""
    return int(sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state)
                   if hasattr(leaf, "dtype")))


def _full(index: tuple, shape: tuple) -> tuple:
    """index (slices, possibly fewer than dims) -> (start, stop) per dim."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(tuple(index)))
    out = []
    for s, dim in zip(index, shape):
        start, stop, step = s.indices(dim)
        if step != 1:
            raise ValueError(f"slice {s} must have step 1")
        out.append((start, max(start, stop)))
    return tuple(out)


class QuantizedSlices:
    """An int8 view of a float checkpoint tensor read one box at a time (the interface
    of models.checkpoint.TensorSlices: `shape`, `read(index)`), plus `scales`, the same
    for its scales. The tensor is [stacked..., in..., out...] (`stacked` leading axes of
    experts, each quantized on its own). Scales of a box of columns are cached, so the
    weight's slice and its scale's slice (sharded alike) cost one computation."""

    def __init__(self, tensor, num_in: int, stacked: int = 0):
        self.tensor = tensor  # float reader: shape, read(index) -> np.ndarray
        self.num_in, self.stacked = num_in, stacked
        self.shape = tuple(tensor.shape)
        self._scales: dict[tuple, np.ndarray] = {}

    def _inputs(self) -> range:
        return range(self.stacked, self.stacked + self.num_in)

    def _column_scales(self, key: tuple) -> np.ndarray:  # [stacked box..., out box...] f32
        if key not in self._scales:
            k, n = self.stacked, self.num_in
            in_shape = self.shape[k:k + n]
            outer, out_box = key[:k], key[k:]
            per_row = (int(np.prod(in_shape[1:], dtype=np.int64))
                       * int(np.prod([b - a for a, b in key])))
            step = max(1, CHUNK_ELEMENTS // max(per_row, 1))
            amax = None
            for lo in range(0, in_shape[0], step):
                rows = (slice(lo, min(lo + step, in_shape[0])),) + (slice(None),) * (n - 1)
                box = tuple(slice(a, b) for a, b in outer) + rows + tuple(slice(a, b) for a, b in out_box)
                m = np.max(np.abs(self.tensor.read(box).astype(np.float32)), axis=tuple(self._inputs()))
                amax = m if amax is None else np.maximum(amax, m)
            self._scales[key] = scales_from_amax(amax)
        return self._scales[key]

    def read(self, index: tuple = ()) -> np.ndarray:  # the int8 box
        box = _full(index, self.shape)
        inputs = self._inputs()
        values = self.tensor.read(tuple(slice(a, b) for a, b in box))
        key = tuple(b for axis, b in enumerate(box) if axis not in inputs)
        if key not in self._scales and all(box[a] == (0, self.shape[a]) for a in inputs):
            # every input row is here: this box's own max is its columns' max
            self._scales[key] = scales_from_amax(np.max(np.abs(values.astype(np.float32)), axis=tuple(inputs)))
        scale = self._column_scales(key)
        return quantize_with(values, np.expand_dims(scale, tuple(inputs)) if self.stacked else scale)

    @property
    def scales(self) -> "_ScaleSlices":
        return _ScaleSlices(self)


class _ScaleSlices:
    def __init__(self, parent: QuantizedSlices):
        self.parent = parent
        inputs = parent._inputs()
        self.shape = tuple(d for axis, d in enumerate(parent.shape) if axis not in inputs)

    def read(self, index: tuple = ()) -> np.ndarray:  # [stacked box..., out box...] f32
        return self.parent._column_scales(_full(index, self.shape)).copy()
