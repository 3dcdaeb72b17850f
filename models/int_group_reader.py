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
# a GGUF's packable tensor (models/gguf/int_codes.py) is its projection's only part
GGUF = "gguf"
NEEDS = {"gptq": ("qweight", "qzeros", "scales"), "awq": ("qweight", "qzeros", "scales"),
         "ct_pack": ("weight_packed", "weight_scale", "weight_shape"), "ct_int": ("weight", "weight_scale"),
         GGUF: (GGUF,)}


def projection_of(name: str, stored: StoredTensor, table: dict, fmt: str) -> tuple[str, str] | None:
    """(the projection's `.weight` name, suffix) when `name` is one of its stored int tensors."""
    if fmt == GGUF:
        spec = table.get(name)
        parts = (spec,) if isinstance(spec, HFTensor) else spec or ()
        packable = getattr(stored, "info", None) is not None and len(stored.shape) == 2
        return (name, GGUF) if packable and parts and parts[0].param_path[-1] in int_group.INPUT_AXES else None
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
    return vals.reshape(shape).astype(np.int16)  # v1 zeros may reach 2^bits


def _awq_unpack(words: np.ndarray) -> np.ndarray:  # [rows, cols / 8] int32 -> [rows, cols] codes
    nibbles = _unpack_words(words, 4, 1).reshape(words.shape[0], words.shape[1], 8)
    out = np.empty_like(nibbles)
    out[:, :, list(AWQ_ORDER)] = nibbles
    return out.reshape(words.shape[0], -1)


def unpacked(fmt: str, parts: dict, n_out: int, n_in: int, bits: int, group: int, v1: bool, zero_point: bool = True):
    """The stored tensors -> (Q [out, in] codes, S, Z [groups, out] f32, g_idx [in] or None);
    a GGUF's blocks in the projection's form (bits, group, zero_point)."""
    g = int_group.group_of(group, n_in)
    n_groups = -(-n_in // g)
    if fmt == GGUF:
        from jaxfill.models.gguf.int_codes import codes
        from jaxfill.models.gguf.quants import TYPES

        tensor = parts[GGUF]
        try:
            q, s, z = codes(TYPES[tensor.info.ggml_type][0], tensor.raw_rows(0, tensor.shape[0]), n_in,
                            (bits, group, zero_point))
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        g_idx = None
    elif fmt == "gptq":
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
            q = _read(parts["weight"]).astype(np.int16) + half
        s = _read(parts["weight_scale"], np.float32).T
        if "weight_zero_point" not in parts:
            z = np.full(s.shape, half, np.int16)
        elif fmt == "ct_pack":
            z = _unpack_words(_read(parts["weight_zero_point"]).T, bits, 1)[:, :n_out]
        else:
            z = _read(parts["weight_zero_point"]).astype(np.int16).T + half
        g_idx = None
    for what, a, want in (("codes", q, (n_out, n_in)), ("scales", s, (n_groups, n_out)),
                          ("zero points", z, (n_groups, n_out))):
        if a.shape != want:
            raise CheckpointError(f"its {what} unpack to {list(a.shape)}; [{n_out}, {n_in}] in groups of {g} "
                                  f"({bits} bits) needs {list(want)}")
    return q.astype(np.uint8), s, z.astype(np.float32), g_idx


def stored_shapes(fmt: str, n_out: int, n_in: int, bits: int, n_groups: int) -> dict[str, tuple]:
    """Each stored tensor's shape, checked on the headers before any data is read."""
    words = lambda n: -(-n * bits // 32)  # noqa: E731
    if fmt == GGUF:
        return {GGUF: (n_out, n_in)}
    if fmt == "gptq":
        return {"qweight": (words(n_in), n_out), "qzeros": (n_groups, words(n_out)), "scales": (n_groups, n_out),
                "g_idx": (n_in,)}
    if fmt == "awq":
        return {"qweight": (n_in, words(n_out)), "qzeros": (n_groups, words(n_out)), "scales": (n_groups, n_out)}
    shapes = {"weight_scale": (n_out, n_groups)}
    if fmt == "ct_pack":
        return shapes | {"weight_packed": (n_out, words(n_in)), "weight_zero_point": (words(n_out), n_groups),
                         "weight_shape": (2,)}
    return shapes | {"weight": (n_out, n_in), "weight_zero_point": (n_out, n_groups)}


class _Part:
    """One param of a projection (codes, scale, zero or g_idx), read a box at a time (the
    interface of TensorSlices) from the projection unpacked on first use."""

    def __init__(self, owner: "IntGroupReader", key: str, shape: tuple):
        self.owner, self.key, self.shape = owner, key, shape

    def read(self, index: tuple = ()) -> np.ndarray:
        return np.ascontiguousarray(self.owner.values()[self.key][tuple(index)])


class IntGroupReader:
    """One projection part (`spec`: a fused tensor's rows; one expert of a stack) in our
    layout: `codes`, `scale`, `zero` and (act order) `g_idx`, each with shape and
    read(index). Headers are checked here; the data is read and unpacked when the first
    box is placed, and only the projection placed last stays unpacked."""

    _last: tuple = (None, None)  # (reader, its values): one projection unpacked at a time

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
        n_groups = -(-n_in // int_group.group_of(form.group, n_in))
        for suffix, want in stored_shapes(fmt, n_out, n_in, form.bits, n_groups).items():
            if suffix in parts and tuple(parts[suffix].shape) != want:
                raise CheckpointError(f"int tensor {name[:-len('weight')] + suffix!r} is {list(parts[suffix].shape)}:"
                                      f" [{n_out}, {n_in}] in {form.bits} bits, groups of "
                                      f"{int_group.group_of(form.group, n_in)} ({fmt}) needs {list(want)}")
        if form.act_order and "g_idx" not in parts:
            raise CheckpointError(f"int tensor {name!r} has no g_idx, and desc_act is true")
        self.name, self.parts, self.spec, self.fmt, self.form, self.v1 = name, parts, spec, fmt, form, v1
        outs, ins = tuple(spec.stored_shape[:k]), tuple(spec.stored_shape[k:])
        lo, hi = spec.rows or (0, n_out)
        self.outs, self.ins, self.rows = outs, ins, (lo, hi)
        float_shape = ins + outs
        self.codes = _Part(self, "codes", int_group.packed_shape(float_shape, len(ins), form.bits))
        self.scale = _Part(self, "scale", (n_groups,) + outs)
        self.zero = _Part(self, "zero", (n_groups,) + outs) if form.zero_point else None
        self.g_idx = _Part(self, "g_idx", ins) if form.act_order else None

    def _unpacked(self):
        """(Q [out, in], S, Z [groups, out], g_idx [in]): read, unpacked and checked."""
        (n_out, n_in), form = self.spec.hf_shape, self.form
        try:
            q, s, z, g_idx = unpacked(self.fmt, self.parts, n_out, n_in, form.bits, form.group, self.v1,
                                      form.zero_point)
        except CheckpointError as e:
            raise CheckpointError(f"int tensor {self.name!r}: {e}") from None
        if not form.zero_point and np.any(z != 2 ** (form.bits - 1)):  # symmetric: none kept
            raise CheckpointError(f"int tensor {self.name!r} stores zero points other than {2 ** (form.bits - 1)}, "
                                  "but its quantization_config says symmetric")
        plain = np.arange(n_in, dtype=np.int32) // int_group.group_of(form.group, n_in)
        if g_idx is None:
            return q, s, z, plain
        if g_idx.min() < 0 or g_idx.max() >= s.shape[0]:
            raise CheckpointError(f"int tensor {self.name!r}: g_idx names groups outside its {s.shape[0]}")
        if not form.act_order and not np.array_equal(g_idx, plain):
            raise CheckpointError(f"int tensor {self.name!r}: g_idx reorders the groups but desc_act is false")
        return q, s, z, g_idx

    def values(self) -> dict[str, np.ndarray]:
        """This part's params in our layout, unpacked once while it is being placed."""
        if IntGroupReader._last[0] is not self:
            q, s, z, g_idx = self._unpacked()
            (lo, hi), perm = self.rows, self.spec.perm
            codes = q[lo:hi].reshape(self.outs + self.ins).transpose(perm)
            values = {"codes": int_group.pack(codes, len(self.ins), self.form.bits),
                      "scale": np.ascontiguousarray(s[:, lo:hi]).reshape((s.shape[0],) + self.outs),
                      "zero": np.ascontiguousarray(z[:, lo:hi]).reshape((z.shape[0],) + self.outs),
                      "g_idx": g_idx.reshape(self.ins), "dequantized": (q, s, z, g_idx)}
            IntGroupReader._last = (self, values)
        return IntGroupReader._last[1]

    def __call__(self, target: np.dtype):
        """The param's values dequantized, (Q - Z) * S in f32 then `target` (a model kept in
        auto or int8 on an int checkpoint), read whole on first use."""
        return _Dequantized(self, np.dtype(target))

    def pairs(self, path: tuple) -> list[tuple[tuple, object, tuple]]:
        """(param path, reader, stack) of the codes and each IntGroupScales param: an
        expert's codes, scales and zeros stack alike (the input axis is the groups')."""
        scales, stack = tuple(path[:-1]) + (path[-1] + "_scale",), self.spec.stack
        out = [(path, self.codes, stack), (scales + ("scale",), self.scale, stack)]
        out += [(scales + ("zero",), self.zero, stack)] if self.zero is not None else []
        return out + ([(scales + ("g_idx",), self.g_idx, ())] if self.g_idx is not None else [])


class _Dequantized:
    """A projection's dequantized values in param layout (shape, read(index))."""

    def __init__(self, owner: IntGroupReader, target: np.dtype):
        self.owner, self.target = owner, target
        self.shape = tuple(owner.spec.stored_shape[p] for p in owner.spec.perm)

    def read(self, index: tuple = ()) -> np.ndarray:
        q, s, z, idx = self.owner.values()["dequantized"]
        lo, hi = self.owner.rows
        w = (q[lo:hi].astype(np.float32) - z[idx].T[lo:hi]) * s[idx].T[lo:hi]  # [out, in]
        w = w.reshape(self.owner.spec.stored_shape).transpose(self.owner.spec.perm)
        return np.ascontiguousarray(w[tuple(index)], dtype=self.target)
