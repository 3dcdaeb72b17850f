"""The loader's reader of one fp8 block-scaled checkpoint tensor (models/fp8_block.py): its
stored values for a param kept in fp8, else its values dequantized a box at a time."""

from __future__ import annotations

import numpy as np

import jaxfill.models.fp8_block as fp8_block
from jaxfill.models.safetensors_file import CheckpointError, StoredTensor, TensorSlices, rows_of
from jaxfill.models.families.base import HFTensor


class Fp8Reader:
    """target dtype -> reader of an fp8 HF tensor in param layout: its stored fp8 values
    (a param kept in fp8), else dequantized (models/fp8_block.py); `scales`: the reader of
    its `<param>_scale` param, [ceil(in / B1), ceil(out / B0)]."""

    def __init__(self, name: str, stored: StoredTensor, scales: StoredTensor | None, spec: HFTensor, block: tuple):
        if scales is None:
            raise CheckpointError(f"fp8 tensor {name!r} has no {name[:-len('.weight')]}{fp8_block.HF_SCALE}")
        k = len(spec.stored_shape) - len(spec.perm[:spec.perm.index(0)])  # axes flattening to HF's out
        if len(spec.hf_shape) != 2 or spec.perm != tuple(range(k, len(spec.perm))) + tuple(range(k)):
            raise CheckpointError(f"fp8 tensor {name!r} {list(spec.hf_shape)} is not an [out, in] projection "
                                  "the block-scaled loader maps")
        (n_out, n_in), (b0, b1) = spec.hf_shape, block
        want = (-(-n_out // b0), -(-n_in // b1))
        start, stop = spec.rows or (0, n_out)
        if scales.shape != want or scales.dtype != np.float32 or start % b0:
            cut = f", and part rows from {start} on a block boundary" if start % b0 else ""
            raise CheckpointError(f"tensor {name[:-len('.weight')] + fp8_block.HF_SCALE!r} is {list(scales.shape)} "
                                  f"{scales.dtype}: {list(spec.hf_shape)} in {b0}x{b1} blocks "
                                  f"(model.weight_block_size) needs {list(want)} float32{cut}")
        self.weight = rows_of(stored, spec.rows)
        self.spec, self.block, self.num_out = spec, block, k
        rows = rows_of(scales, (start // b0, -(-stop // b0)))
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
