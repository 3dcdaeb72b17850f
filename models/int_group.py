"""Group-quantized integer projection weights (model.weight_dtype = int_group): AWQ, GPTQ
and compressed-tensors checkpoints kept packed on the device.

Every such format stores, per Linear weight W [out, in], unsigned codes q in [0, 2^bits)
and per (group of inputs, output) an f32-exact scale s and zero point z:

    W[o, i] = (q[o, i] - z[g(i), o]) * s[g(i), o],  g(i) = i // group  (or g_idx[i])

(signed formats, compressed-tensors' symmetric ones, become unsigned with z = 2^(bits-1)).
models/int_group_reader.py turns each file layout into this one.

On the device, a projection param [in..., out...] (models/quant.py's layouts) holds the
codes as uint8: for 4 bits two a byte along the last input axis (element 2j in the low
nibble, 2j+1 in the high one), for 8 bits one a byte. Beside it, `IntGroupScales` holds
`scale` and `zero` f32 [groups, out...] (the inputs flattened in C order, as HF's
[out, in] is, then cut into groups; the last group may be partial) and, for GPTQ's
act-order checkpoints, `g_idx` int32 [in...]: each input's group. The matmul dequantizes
inside the jitted program (`dequantize`: (q - z) * s in f32, one rounding to the compute
dtype), which XLA fuses into the dot's operand: weight-only, never a bf16 copy kept.

A tensor split of the inputs (o and down, row parallel) keeps whole groups on each
device (`split_error`, refused by engine/validation.py); act-order scales stay whole
(replicated) since any input may use any group.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

BITS = (4, 8)
# projection param -> its input axes (the rest are outputs, a MoE's (gate, up) axis among them)
INPUT_AXES = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1, "experts_gate_up": 1, "experts_down": 1}
# leading axes stacking experts ([E, in, out...]); each expert quantized on its own
STACKED = {"experts_gate_up": 1, "experts_down": 1}


class IntGroupFormat(NamedTuple):
    """How a model keeps its projections (ModelConfig.weight_form for int_group)."""
    bits: int
    group: int  # inputs per group; -1: one group over all inputs (per output channel)
    zero_point: bool  # the checkpoint stores zero points (asymmetric); else z = 2^(bits-1)
    act_order: bool  # GPTQ desc_act: g_idx [in] names each input's group
    experts_only: bool = False  # the rest unquantized (compressed-tensors' ignore list: Kimi K2-Thinking)
    # projections kept in another (bits, group, zero_point): ((name, bits, group, zero_point), ...)
    others: tuple = ()

    def of(self, name: str) -> "IntGroupFormat":
        """The form projection `name` is kept in (a GGUF mixes types per projection)."""
        for other, bits, group, zero_point in self.others:
            if other == name:
                return self._replace(bits=bits, group=group, zero_point=zero_point, others=())
        return self


def parse_forms(text: str) -> tuple:
    """ModelConfig.weight_int_forms "name:bits:group:zero_point,..." -> IntGroupFormat.others."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        parts = item.split(":")
        if len(parts) != 4 or parts[0] not in INPUT_AXES or not all(p.lstrip("-").isdigit() for p in parts[1:]):
            raise ValueError(f"{item!r} is not name:bits:group:zero_point with name one of {', '.join(INPUT_AXES)}")
        bits, group, zero = (int(p) for p in parts[1:])
        if bits not in BITS or (group != -1 and (group <= 0 or group % 2)) or zero not in (0, 1):
            raise ValueError(f"{item!r}: bits 4 or 8, an even group size or -1, zero_point 0 or 1")
        out.append((parts[0], bits, group, bool(zero)))
    return tuple(out)


def group_of(form_group: int, n_in: int) -> int:
    return n_in if form_group == -1 else form_group


def packed_shape(shape: tuple, num_in: int, bits: int, stacked: int = 0) -> tuple:
    """The uint8 param of a [stacked..., in..., out...] projection: the last input axis
    halved for 4 bits."""
    a = stacked + num_in - 1
    if bits == 8:
        return tuple(shape)
    if shape[a] % 2:
        raise ValueError(f"int4 packs two inputs a byte: the last input axis of {list(shape)} must be even")
    return tuple(shape[:a]) + (shape[a] // 2,) + tuple(shape[a + 1:])


def scale_shape(shape: tuple, num_in: int, group: int, stacked: int = 0) -> tuple:
    n_in = math.prod(shape[stacked:stacked + num_in])
    return tuple(shape[:stacked]) + (-(-n_in // group_of(group, n_in)),) + tuple(shape[stacked + num_in:])


def pack(q, num_in: int, bits: int, stacked: int = 0):  # [stacked..., in..., out...] codes -> packed uint8
    """Two 4-bit codes a byte along the last input axis (numpy or jax)."""
    xp = jnp if isinstance(q, jax.Array) else np
    q = q.astype(xp.uint8)
    if bits == 8:
        return q
    a = stacked + num_in - 1
    shape = q.shape[:a] + (q.shape[a] // 2, 2) + q.shape[a + 1:]
    pairs = q.reshape(shape)
    low, high = xp.take(pairs, 0, axis=a + 1), xp.take(pairs, 1, axis=a + 1)
    return (low | (high << 4)).astype(xp.uint8)


def unpack(packed,  # packed_shape(...) uint8
           num_in: int, bits: int, stacked: int = 0):  # [stacked..., in..., out...] uint8 codes
    xp = jnp if isinstance(packed, jax.Array) else np
    if bits == 8:
        return packed
    a = stacked + num_in - 1
    pairs = xp.stack([packed & 15, packed >> 4], axis=a + 1)
    return pairs.reshape(packed.shape[:a] + (2 * packed.shape[a],) + packed.shape[a + 1:])


def dequantize(packed,  # [stacked..., in... (last halved for 4 bits), out...] uint8
               scale, zero,  # [stacked..., groups, out...] f32; zero None: 2^(bits-1) (symmetric)
               g_idx,  # [in...] int32, or None: input i in group i // group
               num_in: int, bits: int, group: int, dtype=np.float32, stacked: int = 0):  # like packed, unpacked
    """(q - z) * s in f32, one rounding to `dtype` (numpy or jax)."""
    xp = jnp if isinstance(packed, jax.Array) else np
    q = unpack(packed, num_in, bits, stacked)
    lead, ins, outs = q.shape[:stacked], q.shape[stacked:stacked + num_in], q.shape[stacked + num_in:]
    n_in = math.prod(ins)
    flat = q.reshape(lead + (n_in,) + outs).astype(np.float32)
    given = [a for a in (scale, zero) if a is not None]
    if g_idx is None:
        g = group_of(group, n_in)
        take = (slice(None),) * stacked + (slice(0, n_in),)
        s, *z = (xp.repeat(a.astype(np.float32), g, axis=stacked)[take] for a in given)
    else:
        idx = g_idx.reshape(n_in)
        s, *z = (xp.take(a.astype(np.float32), idx, axis=0) for a in given)
    z = z[0] if z else np.float32(2 ** (bits - 1))
    return ((flat - z) * s).astype(dtype).reshape(q.shape)


def quantize(w,  # [stacked..., in..., out...] float (numpy or jax)
             num_in: int, form: IntGroupFormat,
             stacked: int = 0):  # (packed uint8, scale, zero [stacked..., groups, out...] f32)
    """Min/max group quantization (GPTQ's and AWQ's grid, zero inside [min, max]): random
    init of an int_group model, so a random-init one is the float one quantized."""
    xp = jnp if isinstance(w, jax.Array) else np
    lead, ins, outs = w.shape[:stacked], w.shape[stacked:stacked + num_in], w.shape[stacked + num_in:]
    n_in = math.prod(ins)
    g = group_of(form.group, n_in)
    n_groups = -(-n_in // g)
    flat = w.astype(np.float32).reshape(lead + (n_in,) + outs)
    pad = [(0, 0)] * stacked + [(0, n_groups * g - n_in)] + [(0, 0)] * len(outs)
    tiles = xp.pad(flat, pad, mode="edge").reshape(lead + (n_groups, g) + outs)
    k = stacked + 1  # the axis within a group
    top = np.float32(2 ** form.bits - 1)
    if form.zero_point:
        lo, hi = xp.minimum(tiles.min(axis=k), 0), xp.maximum(tiles.max(axis=k), 0)
        scale = (hi - lo) / top
        scale = xp.where(scale > 0, scale, np.float32(1)).astype(np.float32)
        zero = xp.clip(xp.rint(-lo / scale), 0, top).astype(np.float32)
    else:
        half = np.float32(2 ** (form.bits - 1))
        amax = xp.abs(tiles).max(axis=k)
        scale = xp.where(amax > 0, amax / (half - 1), np.float32(1)).astype(np.float32)
        zero = xp.full(scale.shape, half, np.float32)
    take = (slice(None),) * stacked + (slice(0, n_in),)
    s, z = (xp.repeat(a, g, axis=stacked)[take] for a in (scale, zero))
    q = xp.clip(xp.rint(flat / s) + z, 0, top).reshape(w.shape)
    return pack(q, num_in, form.bits, stacked), scale, zero


def scale_axes(axes: tuple, num_in: int, form: IntGroupFormat, stacked: int = 0) -> tuple:
    """The scales split their groups like the first input axis (whole groups a device:
    `split_error`), except act-order's (any input uses any group) and one group per column."""
    whole = form.act_order or form.group == -1
    return tuple(axes[:stacked]) + (None if whole else axes[stacked],) + tuple(axes[stacked + num_in:])


class IntGroupScales(nnx.Module):
    """A packed projection's scales, zero points and (act order) input groups; qeinsum
    (models/quant.py) takes it as the projection's `scale`."""

    def __init__(self, scale, zero, g_idx,  # [stacked..., groups, out...] f32 twice; [in...] int32 or None
                 axes: tuple, num_in: int, form: IntGroupFormat, n_in: int, stacked: int = 0):
        kw = dict(eager_sharding=False)
        self.scale = nnx.Param(scale, out_sharding=scale_axes(axes, num_in, form, stacked), **kw)
        # symmetric formats: every zero point is 2^(bits-1), none stored
        self.zero = nnx.Param(zero, out_sharding=scale_axes(axes, num_in, form, stacked), **kw) \
            if form.zero_point else None
        self.g_idx = nnx.Param(g_idx, out_sharding=tuple(axes[:num_in]), **kw) if form.act_order else None
        self.num_in, self.bits, self.group, self.stacked = num_in, form.bits, group_of(form.group, n_in), stacked

    def dequantize(self, packed: jax.Array, dtype) -> jax.Array:
        g_idx = None if self.g_idx is None else self.g_idx[...]
        zero = None if self.zero is None else self.zero[...]
        return dequantize(packed, self.scale[...], zero, g_idx, self.num_in, self.bits, self.group, dtype,
                          self.stacked)


def projection(w: jax.Array,  # [stacked..., in..., out...] float: the float model's init
               axes: tuple, num_in: int, form: IntGroupFormat,
               stacked: int = 0) -> tuple[nnx.Param, IntGroupScales]:
    """The packed param and its scales from a float init (models/layers.py's `projection`)."""
    if stacked and form.act_order:
        raise ValueError("int_group act order (g_idx) has no form for stacked experts")
    packed, scale, zero = quantize(w, num_in, form, stacked)
    n_in = math.prod(w.shape[stacked:stacked + num_in])
    g_idx = None
    if form.act_order:
        g_idx = (jnp.arange(n_in, dtype=jnp.int32) // group_of(form.group, n_in)).reshape(w.shape[:num_in])
    return (nnx.Param(packed, out_sharding=axes, eager_sharding=False),
            IntGroupScales(scale, zero, g_idx, axes, num_in, form, n_in, stacked))


def split_error(name: str, shape: tuple, num_in: int, split: int, form: IntGroupFormat,
                stacked: int = 0) -> str | None:
    """Why splitting the first input axis of `name` [stacked..., in..., out...] (float
    shape) `split` ways cuts a group, or None (each device holds dim / split of it times
    the other inputs)."""
    shape = tuple(shape[stacked:])
    n_in = math.prod(shape[:num_in])
    if split <= 1 or form.act_order or form.group == -1:
        return None
    per_device = shape[0] // split * math.prod(shape[1:num_in])
    if per_device % form.group:
        return (f"{name} {list(shape)} splits its inputs {split} ways into {per_device} per device, not a "
                f"multiple of the {form.group}-input group (of {n_in})")
    return None
