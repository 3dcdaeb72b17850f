"""GGUF's 32-value block formats as models/int_group.py's codes, scales and zero points,
so a Q4_0, Q4_1 or Q8_0 file's projections stay packed on the device (model.weight_dtype =
int_group, the default for such a file) instead of being dequantized at load.

Each block of 32 inputs of one output row is one group (W = (q - z) * s):
* Q4_0: 4-bit q, value d * (q - 8): s = d, z = 8 (symmetric, no zero points kept);
* Q8_0: int8 c, value d * c: q = c + 128 (uint8), s = d, z = 128 (symmetric);
* Q4_1: 4-bit q, value d * q + m: s = d, z = -m / d, a float zero point. A block with
  d = 0 holds m everywhere (llama.cpp writes q = 0 there): s = m, z = q - 1.
f16 scales become f32 exactly; Q4_1's z is one f32 rounding, so a weight may differ from
ggml's d * q + m by an ulp or so of its size.

A file packs only when every projection tensor (q, k, v, o, gate, up, down) has the same
one of these types: int_group keeps one format a model. Others (the k-quants, a file that
mixes types) load dequantized as before.
"""

from __future__ import annotations

import numpy as np

import jaxfill.models.gguf.quants as quants
from jaxfill.models.gguf.quants import _f16, _nibbles

GROUP = 32
# ggml type name -> (bits, zero points stored)
PACKED = {"Q4_0": (4, False), "Q4_1": (4, True), "Q8_0": (8, False)}
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def packed_type(tensors: dict) -> str | None:
    """The ggml type name every projection tensor of the file shares, when it is one int_group
    keeps; None: load dequantized."""
    kinds = {quants.TYPES[info.ggml_type][0] for name, info in tensors.items()
             if name.startswith("blk.") and name.endswith(".weight") and name.split(".")[2] in PROJECTIONS}
    return kinds.pop() if len(kinds) == 1 and next(iter(kinds)) in PACKED else None


def quantization_config(tensors: dict) -> dict | None:
    """The config.json quantization_config a packable file loads with (models/config/int_quantization.py)."""
    kind = packed_type(tensors)
    return None if kind is None else {"quant_method": "gguf", "ggml_type": kind}


def codes(kind: str, rows: np.ndarray,  # [out, row bytes] uint8: whole rows of blocks
          n_in: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(Q [out, in] uint8 codes, S and Z [in / 32, out] f32) of one tensor's rows."""
    _, per_block, nbytes, _ = quants.TYPES[quants.NAMES[kind]]
    n_out = rows.shape[0]
    blocks = np.ascontiguousarray(rows).reshape(-1, nbytes)  # [out * groups, bytes]
    d = _f16(blocks, 0)[:, 0]
    if kind == "Q8_0":
        q = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        z = np.full(d.shape, 128, np.float32)
    else:
        start = 2 if kind == "Q4_0" else 4
        q = _nibbles(blocks[:, None, start:start + 16]).reshape(len(blocks), per_block)
        z = np.full(d.shape, 8, np.float32)
        if kind == "Q4_1":
            m = _f16(blocks, 2)[:, 0]
            flat = d == 0
            if np.any(flat & (q.min(axis=1) != q.max(axis=1))):
                raise ValueError("a Q4_1 block with scale 0 holds different codes, which no scale and zero "
                                 "point reproduce")
            with np.errstate(divide="ignore", invalid="ignore"):
                z = np.where(flat, q[:, 0].astype(np.float32) - 1, -m / d).astype(np.float32)
            d = np.where(flat, m, d).astype(np.float32)
    groups = n_in // GROUP
    return (q.reshape(n_out, n_in), d.reshape(n_out, groups).T.copy(), z.reshape(n_out, groups).T.copy())
