"""The loader's reader of one AWQ / GPTQ / compressed-tensors projection: its stored
tensors turned into models/int_group.py's layout (uint8 codes in param layout, two 4-bit
codes a byte; f32 scales and zero points [groups, out...]; act order's g_idx [in...]).

Every format is first read into one form, HF's [out, in] unsigned codes Q, scales and
zero points S, Z [groups, out] and g_idx [in] (W = (Q - Z[g]) * S[g]):

* GPTQ (AutoGPTQ / GPTQModel `gptq` and `gptq_v2`): `qweight` int32 [in * bits / 32, out],
  codes packed along the inputs, input 8r + j (4 bits) in bits 4j..4j+3 of row r;
  `qzeros` int32 [groups, out * bits / 32] packed along the outputs the same way, holding
  z - 1 in the v1 format (its loaders add the 1 back, no re-mask) and z in v2; `scales`
  f16 [groups, out]; `g_idx` int32 [in].
* AWQ GEMM: `qweight` int32 [in, out / 8] packed along the outputs, output 8c + ORDER[j]
  in nibble j (ORDER = 0, 2, 4, 6, 1, 3, 5, 7: AutoAWQ's interleave); `qzeros` the same on
  [groups, out / 8]; `scales` f16 [groups, out]; groups of consecutive inputs.
* compressed-tensors pack-quantized: `weight_packed` int32 [out, in * bits / 32], codes
  offset by 2^(bits-1) packed along the inputs from bit 0 up; `weight_scale` [out, groups];
  `weight_zero_point` (asymmetric only) [out * bits / 32, groups] packed along the outputs;
  `weight_shape` [out, in]. int-quantized: `weight` int8 [out, in] (signed), `weight_scale`
  [out, groups] and an unpacked int8 `weight_zero_point` where asymmetric.

The whole stored tensors of one projection are read once (its codes are an eighth of an
f32 copy) and each device's box is cut from the result.
"""

from __future__ import annotations

import numpy as np

import jaxfill.models.int_group as int_group
from jaxfill.models.families.base import HFTensor
from jaxfill.models.safetensors_file import CheckpointError, StoredTensor, TensorSlices

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of a word holds output 8c + AWQ_ORDER[j]
# stored suffix of a projection `<name>.weight` -> the format that writes it
SUFFIXES = {"qweight": ("gptq", "awq"), "qzeros": ("gptq", "awq"), "scales": ("gptq", "awq"), "g_idx": ("gptq",),
            "weight_packed": ("ct_pack",), "weight_scale": ("ct_pack", "ct_int"),
            "weight_zero_point": ("ct_pack", "ct_int"), "weight_shape": ("ct_pack",), "weight": ("ct_int",)}
NEEDS = {"gptq": ("qweight", "qzeros", "scales"), "awq": ("qweight", "qzeros", "scales"),
         "ct_pack": ("weight_packed", "weight_scale", "weight_shape"), "ct_int": ("weight", "weight_scale")}


def projection_of(name: str, stored: StoredTensor, table: dict, fmt: str) -> tuple[str, str] | None:
    """(the projection's `.weight` name, suffix) when `name` is one of its stored int tensors."""
    stem, _, suffix = name.rpartition(".")
    if fmt not in SUFFIXES.get(suffix, ()):
        return None
    base = stem + ".weight"
    spec = table.get(base)
    if spec is None:
        return None
    parts = (spec,) if isinstance(spec, HFTensor) else spec
    if parts[0].param_path[-1] not in int_group.INPUT_AXES:
        return None
    if suffix == "weight" and np.dtype(stored.dtype) != np.int8:
        return None  # a float weight: the loader refuses it for a packed param
    return base, suffix


def _read(stored: StoredTensor, dtype=None) -> np.ndarray:
    return TensorSlices(stored, stored.shape, tuple(range(len(stored.shape))), np.dtype(dtype or stored.dtype)).read()


def _unpack_words(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 words -> codes, 32 / bits a word from bit 0 up, spread along `axis` (unsigned)."""
    per = 32 // bits
    u = np.ascontiguousarray(words).view(np.uint32)
    shifts = (np.arange(per, dtype=np.uint32) * bits).reshape((per,) + (1,) * (u.ndim - axis - 1))
    vals = (np.expand_dims(u, axis + 1) >> shifts) & np.uint32(2 ** bits - 1)  # [..., n, per, ...]
    shape = u.shape[:axis] + (u.shape[axis] * per,) + u.shape[axis + 1:]
    return vals.reshape(shape).astype(np.int64)


def _awq_unpack(words: np.ndarray) -> np.ndarray:  # [rows, cols / 8] int32 -> [rows, cols] codes
    nibbles = _unpack_words(words, 4, 1).reshape(words.shape[0], words.shape[1], 8)
    out = np.empty_like(nibbles)
    out[:, :, list(AWQ_ORDER)] = nibbles
    return out.reshape(words.shape[0], -1)


def unpacked(fmt: str, parts: dict, n_out: int, n_in: int, bits: int, group: int, v1: bool):
    """The stored tensors -> (Q [out, in] codes, S, Z [groups, out] f32, g_idx [in] or None)."""
    g = int_group.group_of(group, n_in)
    n_groups = -(-n_in // g)
    if fmt == "gptq":
        q = _unpack_words(_read(parts["qweight"]), bits, 0)[:n_in].T
        z = _unpack_words(_read(parts["qzeros"]), bits, 1)[:, :n_out] + (1 if v1 else 0)
        s = _read(parts["scales"], np.float32)
        g_idx = _read(parts["g_idx"]).astype(np.int32) if "g_idx" in parts else None
    elif fmt == "awq":
        q = _awq_unpack(_read(parts["qweight"]))[:, :n_out].T
        z = _awq_unpack(_read(parts["qzeros"]))[:, :n_out]
        s, g_idx = _read(parts["scales"], np.float32), None
    else:
        half = 2 ** (bits - 1)
        if fmt == "ct_pack":
            shape = tuple(int(d) for d in _read(parts["weight_shape"]).reshape(-1))
            if shape != (n_out, n_in):
                raise CheckpointError(f"weight_shape {list(shape)} is not the model's [{n_out}, {n_in}]")
            q = _unpack_words(_read(parts["weight_packed"]), bits, 1)[:, :n_in]
        else:
            q = _read(parts["weight"]).astype(np.int64) + half
        s = _read(parts["weight_scale"], np.float32).T
        if "weight_zero_point" not in parts:
            z = np.full(s.shape, half, np.int64)
        elif fmt == "ct_pack":
            z = _unpack_words(_read(parts["weight_zero_point"]).T, bits, 1)[:, :n_out]
        else:
            z = _read(parts["weight_zero_point"]).astype(np.int64).T + half
        g_idx = None
    for what, a, want in (("codes", q, (n_out, n_in)), ("scales", s, (n_groups, n_out)),
                          ("zero points", z, (n_groups, n_out))):
        if a.shape != want:
            raise CheckpointError(f"its {what} unpack to {list(a.shape)}; [{n_out}, {n_in}] in groups of {g} "
                                  f"({bits} bits) needs {list(want)}")
    return q, s, z.astype(np.float32), g_idx


class _Whole:
    """A param computed whole once, read a box at a time (the interface of TensorSlices)."""

    def __init__(self, value: np.ndarray):
        self.value, self.shape = value, value.shape

    def read(self, index: tuple = ()) -> np.ndarray:
        return np.ascontiguousarray(self.value[tuple(index)])


class IntGroupReader:
    """One projection part (`spec`: a fused tensor's rows) in our layout: `codes`, `scale`,
    `zero` and (act order) `g_idx`, each with shape and read(index)."""

    def __init__(self, name: str, parts: dict, spec: HFTensor, fmt: str, form: int_group.IntGroupFormat, v1: bool):
        missing = [s for s in NEEDS[fmt] if s not in parts]
        if missing:
            raise CheckpointError(f"int tensor {name!r} ({fmt}) lacks {', '.join(missing)}")
        if len(spec.hf_shape) != 2 or (spec.stack and form.act_order):
            raise CheckpointError(f"int tensor {name!r} {list(spec.hf_shape)} is not an [out, in] projection (one "
                                  "expert's, without act order)")
        k = len(spec.stored_shape) - spec.perm.index(0)  # stored axes flattening to HF's out
        if spec.perm != tuple(range(k, len(spec.perm))) + tuple(range(k)):
            raise CheckpointError(f"int tensor {name!r} is not an [out, in] projection the int loader maps")
        n_out, n_in = spec.hf_shape
        try:
            q, s, z, g_idx = unpacked(fmt, parts, n_out, n_in, form.bits, form.group, v1)
        except CheckpointError as e:
            raise CheckpointError(f"int tensor {name!r}: {e}") from None
        if g_idx is not None:
            plain = np.arange(n_in, dtype=np.int32) // int_group.group_of(form.group, n_in)
            if g_idx.shape != (n_in,) or g_idx.min() < 0 or g_idx.max() >= s.shape[0]:
                raise CheckpointError(f"int tensor {name!r}: g_idx {list(g_idx.shape)} does not name its "
                                      f"{s.shape[0]} groups")
            if not form.act_order and not np.array_equal(g_idx, plain):
                raise CheckpointError(f"int tensor {name!r}: g_idx reorders the groups but desc_act is false")
        elif form.act_order:
            raise CheckpointError(f"int tensor {name!r} has no g_idx, and desc_act is true")
        self.q, self.s, self.z, self.idx = q, s, z, g_idx
        self.spec, self.k, self.form = spec, k, form
        lo, hi = spec.rows or (0, n_out)
        outs, ins = spec.stored_shape[:k], spec.stored_shape[k:]
        num_in = len(ins)
        codes = q[lo:hi].reshape(tuple(outs) + tuple(ins)).transpose(spec.perm)
        self.codes = _Whole(int_group.pack(codes, num_in, form.bits))
        self.scale = _Whole(np.ascontiguousarray(s[:, lo:hi]).reshape((s.shape[0],) + tuple(outs)))
        self.zero = _Whole(np.ascontiguousarray(z[:, lo:hi]).reshape((z.shape[0],) + tuple(outs)))
        self.g_idx = _Whole(g_idx.reshape(ins)) if form.act_order else None

    def __call__(self, target: np.dtype):
        """The param's values dequantized, (Q - Z) * S in f32 then `target` (a model kept in
        auto or int8 on an int checkpoint)."""
        idx = self.idx if self.idx is not None else np.arange(self.q.shape[1]) // int_group.group_of(
            self.form.group, self.q.shape[1])
        w = (self.q.astype(np.float32) - self.z[idx].T) * self.s[idx].T  # [out, in]
        lo, hi = self.spec.rows or (0, w.shape[0])
        ks = self.spec.stored_shape
        return _Whole(np.ascontiguousarray(w[lo:hi].reshape(ks).transpose(self.spec.perm), dtype=target))

    def pairs(self, path: tuple) -> list[tuple[tuple, object, tuple]]:
        """(param path, reader, stack) of the codes and each IntGroupScales param: an
        expert's codes, scales and zeros stack alike (the input axis is the groups')."""
        scales, stack = tuple(path[:-1]) + (path[-1] + "_scale",), self.spec.stack
        out = [(path, self.codes, stack), (scales + ("scale",), self.scale, stack),
               (scales + ("zero",), self.zero, stack)]
        return out + ([(scales + ("g_idx",), self.g_idx, ())] if self.g_idx is not None else [])

