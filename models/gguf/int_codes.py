"""GGUF's quantized blocks as models/int_group.py's codes, scales and zero points, so a
file's projections stay packed on the device (model.weight_dtype = int_group, the default
for such a file) instead of being dequantized at load.

Each type has a native form (bits a stored code, inputs a group, zero points kept), every
group one row's run of inputs, W = (q - z) * s:
* Q4_0 (4, 32, no): value d * (q - 8): s = d, z = 8;
* Q8_0 (8, 32, no): int8 c, value d * c: q = c + 128, z = 128;
* Q5_0 (8, 32, no): 5-bit q, value d * (q - 16): a byte q + 112, z = 128;
* Q6_K (8, 16, no): 6-bit q, value d * sc * (q - 32) with sc an int8 per 16 values: a byte
  q + 96, s = d * sc (exact in f32), z = 128;
* Q4_1 (4, 32, yes) / Q5_1 (8, 32, yes): value d * q + m: s = d, z = -m / d;
* Q4_K (4, 32, yes) / Q5_K (8, 32, yes): value d * sc * q - dmin * mn with 6-bit sc, mn per
  32 values: s = d * sc (exact), z = dmin * mn / s.
A zero-point group whose scale is 0 holds one value o everywhere (the codes do not matter
there): its codes become 1, s = o, z = 0. The float zero point is one f32 rounding, so a
weight may differ from ggml's by an ulp or so of the group's size; the others are exact.

Per projection (q k v o gate up down), int_group keeps one form for all layers (the layers
stack: engine.scan_layers, mesh.stage). llama.cpp's mixes vary a projection's type by layer
(Q4_K_M: attn_v and ffn_down in Q6_K on some layers, Q4_K on the rest), so a projection
takes the smallest form holding all its types (`common_form`: the widest codes, the
smallest group, zero points if any type has them) and each layer's blocks are lifted into
it (4-bit symmetric codes + 120 into bytes, scales repeated into smaller groups). A file
packs only when every projection's types all have a form here; else (F16 / BF16 / F32
projections) it loads dequantized as before.
"""

from __future__ import annotations

import numpy as np

import jaxfill.models.gguf.quants as quants
from jaxfill.models.gguf.quants import _f16, _nibbles

# ggml type name -> (bits a stored code, inputs a group, zero points stored)
FORMS = {"Q4_0": (4, 32, False), "Q4_1": (4, 32, True), "Q5_0": (8, 32, False), "Q5_1": (8, 32, True),
         "Q8_0": (8, 32, False), "Q4_K": (4, 32, True), "Q5_K": (8, 32, True), "Q6_K": (8, 16, False)}
# GGUF projection tensor (blk.N.<name>.weight) -> the model's param name (models/int_group.py INPUT_AXES)
PROJECTIONS = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "ffn_gate": "gate",
               "ffn_up": "up", "ffn_down": "down"}


def projection_types(tensors: dict) -> dict[str, list[str]]:
    """param name -> the sorted ggml type names its layers' tensors have."""
    kinds: dict[str, set] = {}
    for name, info in tensors.items():
        parts = name.split(".")
        if name.startswith("blk.") and name.endswith(".weight") and parts[2] in PROJECTIONS:
            kinds.setdefault(PROJECTIONS[parts[2]], set()).add(quants.TYPES[info.ggml_type][0])
    return {k: sorted(v) for k, v in kinds.items()}


def common_form(kinds) -> tuple[int, int, bool]:
    """The smallest (bits, group, zero points) that holds every type of `kinds` exactly."""
    forms = [FORMS[k] for k in kinds]
    return max(f[0] for f in forms), min(f[1] for f in forms), any(f[2] for f in forms)


def quantization_config(tensors: dict) -> dict | None:
    """The config.json quantization_config a packable file loads with
    (models/config/int_quantization.py): each projection's types; None: load dequantized."""
    types = projection_types(tensors)
    if not types or any(k not in FORMS for kinds in types.values() for k in kinds):
        return None
    return {"quant_method": "gguf", "ggml_types": {name: ",".join(kinds) for name, kinds in types.items()}}


def _native(kind: str, blocks: np.ndarray):  # [n, block bytes] -> (q [n, per] u8, s, z [n, groups] f32)
    n = len(blocks)
    d = _f16(blocks, 0)  # [n, 1]
    if kind == "Q8_0":
        return (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8), d, np.full_like(d, 128)
    if kind == "Q4_0":
        return _nibbles(blocks[:, None, 2:18]).reshape(n, 32), d, np.full_like(d, 8)
    if kind == "Q5_0":
        return quants.q5_codes(blocks, 2) + np.uint8(112), d, np.full_like(d, 128)
    if kind in ("Q4_1", "Q5_1"):
        q = quants.q5_codes(blocks, 4) if kind == "Q5_1" else _nibbles(blocks[:, None, 4:20]).reshape(n, 32)
        return _affine(q[:, None, :], d, -_f16(blocks, 2))
    if kind == "Q6_K":
        q = quants.q6_codes(blocks) + np.uint8(96)  # [n, 256]
        s = _f16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16]
        return q, s, np.full_like(s, 128)
    scale, minimum = quants.k_scales(blocks[:, 4:16])  # Q4_K / Q5_K: [n, 8] each
    q = quants.q5_k_codes(blocks) if kind == "Q5_K" else _nibbles(blocks[:, 16:144].reshape(-1, 4, 32))
    return _affine(q, d * scale, _f16(blocks, 2) * minimum)


def _affine(q, s, offset):  # value s * q - offset per group: q [n, groups, per]; s, offset [n, groups]
    """(q, s, z = offset / s), and a group of scale 0 (one value -offset) as codes 1, s = -offset, z = 0."""
    flat = s == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(flat, 0, offset / s).astype(np.float32)
    q = np.where(flat[:, :, None], np.uint8(1), q).astype(np.uint8)
    return q.reshape(len(q), -1), np.where(flat, -offset, s).astype(np.float32), z


def codes(kind: str, rows: np.ndarray,  # [out, row bytes] uint8: whole rows of blocks
          n_in: int, form: tuple | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(Q [out, in] uint8 codes, S and Z [in / group, out] f32) of one tensor's rows, in
    `form` (bits, group, zero points: common_form of its projection; default its own)."""
    bits, group, zero_point = form or FORMS[kind]
    native_bits, native_group, native_zero = FORMS[kind]
    if bits < native_bits or native_group % group or (native_zero and not zero_point):
        raise ValueError(f"{kind} blocks do not fit {bits}-bit codes in groups of {group}"
                         f"{'' if zero_point else ' without zero points'}")
    nbytes = quants.TYPES[quants.NAMES[kind]][2]
    n_out = rows.shape[0]
    q, s, z = _native(kind, np.ascontiguousarray(rows).reshape(-1, nbytes))
    if bits > native_bits and not zero_point:  # symmetric 4-bit codes into bytes: centre 8 -> 128
        q, z = q + np.uint8(120), z + 120
    split = native_group // group
    s, z = (np.repeat(a.reshape(n_out, -1), split, axis=1) for a in (s, z))  # [out, in / group]
    return q.reshape(n_out, n_in), s.T.copy(), z.T.astype(np.float32).copy()
