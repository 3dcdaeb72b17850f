"""The loader's reader of one fp8 block-scaled checkpoint tensor (models/fp8_block.py): its
stored values for a param kept in fp8, else its values dequantized a box at a time."""

from __future__ import annotations

import ml_dtypes
import numpy as np

import jaxfill.models.fp8_block as fp8_block
from jaxfill.models.safetensors_file import CheckpointError, StoredTensor, TensorSlices, rows_of
from jaxfill.models.families.base import HFTensor


# scales as stored: f32 (quant_method fp8), or the model dtype (compressed-tensors); read as f32, exactly
SCALE_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))


class Fp8Reader:
    """target dtype -> reader of an fp8 HF tensor in param layout: its stored fp8 values
    (a param kept in fp8), else dequantized (models/fp8_block.py); `scales`: the reader of
    its `<param>_scale` param, [ceil(in / B1), ceil(out / B0)]."""

    def __init__(self, name: str, stored: StoredTensor, scales: StoredTensor | None, spec: HFTensor, block: tuple):
        if scales is None:
            raise CheckpointError(f"fp8 tensor {name!r} has no scales ({name[:-len('.weight')]}{fp8_block.HF_SCALE}, "
                                  "or .weight_scale in compressed-tensors)")
        k = len(spec.stored_shape) - len(spec.perm[:spec.perm.index(0)])  # axes flattening to HF's out
        if len(spec.hf_shape) != 2 or spec.perm != tuple(range(k, len(spec.perm))) + tuple(range(k)):
            raise CheckpointError(f"fp8 tensor {name!r} {list(spec.hf_shape)} is not an [out, in] projection "
                                  "the block-scaled loader maps")
        n_out, n_in = spec.hf_shape
        start, stop = spec.rows or (0, n_out)
        # a whole-axis block (0) spans the HF tensor: a fused tensor's parts share its one scale row
        b0, b1 = fp8_block.sides(block, n_out, n_in)
        want = (-(-n_out // b0), -(-n_in // b1))
        whole_rows = not block[0]
        if scales.shape == (1,) and want == (1, 1):  # compressed-tensors' tensor strategy: [1]
            scales = scales._replace(shape=(1, 1))
        cut_block = start % b0 and not whole_rows
        if scales.shape != want or np.dtype(scales.dtype) not in SCALE_DTYPES or cut_block:
            cut = f", and part rows from {start} on a block boundary" if cut_block else ""
            raise CheckpointError(f"fp8 scales of {name!r} are {list(scales.shape)} {scales.dtype}: "
                                  f"{list(spec.hf_shape)} in {b0}x{b1} blocks (model.weight_block_size) needs "
                                  f"{list(want)} float32, bfloat16 or float16{cut}")
        self.weight = rows_of(stored, spec.rows)
        self.spec, self.block, self.num_out = spec, block, k
        rows = rows_of(scales, (0, 1) if whole_rows else (start // b0, -(-stop // b0)))
        self.hf_scales = TensorSlices(rows, rows.shape, (0, 1), np.dtype(np.float32))
        self.scales = TensorSlices(rows, rows.shape, (1, 0), np.dtype(np.float32))

    def __call__(self, target: np.dtype):
        if fp8_block.is_fp8(target):
            if np.dtype(target) != self.weight.dtype:
                raise CheckpointError(f"fp8 tensor of {self.spec.param_path} is {self.weight.dtype}, the model keeps "
                                      f"{np.dtype(target)}: set model.weight_fp8 = {np.dtype(self.weight.dtype).name}")
            return TensorSlices(self.weight, self.spec.stored_shape, self.spec.perm, np.dtype(target))
        hf = TensorSlices(self.weight, self.weight.shape, (0, 1), self.weight.dtype)
        return fp8_block.DequantizedSlices(hf, self.hf_scales, self.spec.stored_shape, self.spec.perm, self.num_out,
                                           self.block, target)
