"""The safetensors file format: its header entries and reads of one box of a tensor, each
mapping only that box's byte range. Apart from models/checkpoint.py (which turns a
checkpoint into params) so that readers of stored forms (models/fp8_reader.py) build on it
without importing the loader."""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
from typing import Iterator, NamedTuple

import ml_dtypes
import numpy as np

import jaxfill.models.fp8_block as fp8_block
from jaxfill.models.gguf import GGUFTensor
from jaxfill.models.stored_box import stored_box


SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
    **fp8_block.SAFETENSORS,
}


class CheckpointError(ValueError):
    """A checkpoint that does not match the model it is loaded into."""


class StoredTensor(NamedTuple):
    """A tensor's safetensors header entry: where its bytes are, nothing read yet."""
    file: str
    offset: int  # absolute byte offset of the first element in `file`
    dtype: np.dtype
    shape: tuple


@dataclasses.dataclass(frozen=True)
class TensorSlices:
    """A stored tensor seen in param layout, read one box at a time.

    The param is the stored array reshaped (C order) to `stored_shape` and transposed by
    `perm` (param axis i is stored axis perm[i]): both are views, so any box of the param
    is a box of the file, and reading it maps only the byte range from its first to its
    last element. Pages a box skips inside that range (an inner-axis split) are never
    touched."""
    stored: StoredTensor
    stored_shape: tuple
    perm: tuple
    target: np.dtype  # the param's dtype; the cast happens on the slice

    @property
    def shape(self) -> tuple:
        return tuple(self.stored_shape[p] for p in self.perm)

    def read(self, index: tuple = ()) -> np.ndarray:
        """The box `index` (slices with step 1, as make_array_from_callback passes) of the
        param: a new C-contiguous array in the target dtype, independent of the file."""
        box = stored_box(index, self.shape, self.perm)
        lengths = [hi - lo for lo, hi in box]
        if 0 in lengths:
            return np.empty([lengths[p] for p in self.perm], self.target)
        itemsize = np.dtype(self.stored.dtype).itemsize
        strides = [int(np.prod(self.stored_shape[i + 1:], dtype=np.int64)) for i in range(len(box))]
        first = sum(lo * st for (lo, _), st in zip(box, strides))
        last = sum((hi - 1) * st for (_, hi), st in zip(box, strides))
        lo_byte = self.stored.offset + first * itemsize
        aligned = lo_byte - lo_byte % mmap.ALLOCATIONGRANULARITY
        with open(self.stored.file, "rb") as f:
            mapped = mmap.mmap(f.fileno(), self.stored.offset + (last + 1) * itemsize - aligned,
                               offset=aligned, access=mmap.ACCESS_READ)
        try:
            view = np.ndarray(lengths, self.stored.dtype, buffer=mapped, offset=lo_byte - aligned,
                              strides=[st * itemsize for st in strides])
            out = np.array(view.transpose(self.perm), dtype=self.target, order="C")
            del view  # the map cannot close while a view exports it
        finally:
            mapped.close()
        return out


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, name) for name in files]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def read_safetensors(path: str) -> Iterator[tuple[str, StoredTensor]]:
    """Yields (name, header entry) per tensor; reads the header only."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    size = os.path.getsize(path)
    for name, info in header.items():
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        dtype = np.dtype(SAFETENSORS_DTYPES[info["dtype"]])
        start, end = info["data_offsets"]
        shape = tuple(int(n) for n in info["shape"])
        if end - start != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize or 8 + header_len + end > size:
            raise CheckpointError(f"{path}: tensor {name} has data_offsets {info['data_offsets']} that do not "
                                  f"match shape {list(shape)} {info['dtype']} or lie past the end of the file")
        yield name, StoredTensor(path, 8 + header_len + start, dtype, shape)


def rows_of(stored: StoredTensor, rows: tuple | None) -> StoredTensor:
    """Rows [start, stop) of axis 0 of a stored tensor: a contiguous byte range of it."""
    if rows is None:
        return stored
    if isinstance(stored, GGUFTensor):
        return stored.take_rows(rows)
    start, stop = rows
    row_bytes = int(np.prod(stored.shape[1:], dtype=np.int64)) * np.dtype(stored.dtype).itemsize
    return StoredTensor(stored.file, stored.offset + start * row_bytes, stored.dtype,
                        (stop - start,) + tuple(stored.shape[1:]))
