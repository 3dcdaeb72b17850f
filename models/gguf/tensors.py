"""A GGUF tensor seen as its HF tensor, read (and dequantized) a box of rows at a time.

ggml quantizes along each row of the innermost dimension (an HF weight's input axis), so
HF row r is a run of whole blocks: a box of a param needs only the rows its elements lie
in, gathered through the q/k row order (models/gguf/arch.py), then dequantized. The file
is mapped per read and unmapped after, as models/checkpoint.py's TensorSlices does.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxfill.models.config import ConfigError
import jaxfill.models.gguf.quants as quants
from jaxfill.models.gguf.reader import TensorInfo
from jaxfill.models.stored_box import stored_box


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """Rows `start:stop` (HF axis 0) of a stored tensor, in HF row order."""
    path: str
    info: TensorInfo
    order: np.ndarray | None = None  # HF row -> stored row (q/k of a Llama), None: the same
    start: int = 0
    stop: int | None = None

    def __post_init__(self):
        if self.info.ggml_type not in quants.TYPES:
            raise ConfigError(f"GGUF tensor {self.info.name!r} has ggml type {self.info.ggml_type}; supported: "
                              f"{', '.join(name for name, *_ in quants.TYPES.values())}")
        per_block = quants.TYPES[self.info.ggml_type][1]
        if self.info.dims[0] % per_block:
            raise ConfigError(f"GGUF tensor {self.info.name!r}: rows of {self.info.dims[0]} are not whole blocks")

    @property
    def full_rows(self) -> int:
        return int(np.prod(self.info.shape[:-1], dtype=np.int64)) if len(self.info.shape) > 1 else 1

    @property
    def shape(self) -> tuple:
        """The HF shape (of the rows kept)."""
        shape = self.info.shape
        stop = self.full_rows if self.stop is None else self.stop
        return (stop - self.start,) + tuple(shape[1:]) if len(shape) > 1 else shape

    @property
    def dtype(self):
        return np.dtype(np.float32)

    def take_rows(self, rows: tuple | None) -> "GGUFTensor":
        """Rows [start, stop) of what this holds (models/checkpoint.py rows_of)."""
        if rows is None:
            return self
        return dataclasses.replace(self, start=self.start + rows[0], stop=self.start + rows[1])

    def read_rows(self, lo: int, hi: int) -> np.ndarray:
        """HF rows [lo, hi) of this tensor, dequantized: [hi - lo, row values] float32."""
        return quants.dequantize_rows(self.raw_rows(lo, hi), self.info.ggml_type, self.info.dims[0])

    def raw_rows(self, lo: int, hi: int) -> np.ndarray:
        """HF rows [lo, hi) of this tensor as stored: [hi - lo, row bytes] uint8 (its blocks)."""
        values = self.info.dims[0]
        nbytes = quants.row_bytes(self.info.ggml_type, values)
        wanted = np.arange(self.start + lo, self.start + hi)
        stored = wanted if self.order is None else self.order[wanted]
        first, last = (int(stored.min()), int(stored.max()) + 1) if len(stored) else (0, 0)
        mapped = np.memmap(self.path, np.uint8, "r", offset=self.info.offset + first * nbytes,
                           shape=(max(last - first, 0), nbytes))
        try:
            return np.array(mapped[stored - first]) if self.order is not None else np.array(mapped)
        finally:
            del mapped

    def slices(self, stored_shape: tuple, perm: tuple, target) -> "GGUFSlices":
        return GGUFSlices(self, tuple(stored_shape), tuple(perm), np.dtype(target))


@dataclasses.dataclass(frozen=True)
class GGUFSlices:
    """The interface of models/checkpoint.py's TensorSlices (`shape`, `read(index)`): the
    HF tensor reshaped to `stored_shape` and transposed by `perm`, read one box at a time."""
    tensor: GGUFTensor
    stored_shape: tuple
    perm: tuple
    target: np.dtype

    @property
    def shape(self) -> tuple:
        return tuple(self.stored_shape[p] for p in self.perm)

    def read(self, index: tuple = ()) -> np.ndarray:
        box = stored_box(index, self.shape, self.perm)
        lengths = [hi - lo for lo, hi in box]
        if 0 in lengths:
            return np.empty([lengths[p] for p in self.perm], self.target)
        strides = [int(np.prod(self.stored_shape[i + 1:], dtype=np.int64)) for i in range(len(box))]
        first = sum(lo * st for (lo, _), st in zip(box, strides))
        last = sum((hi - 1) * st for (_, hi), st in zip(box, strides))
        row = self.tensor.info.dims[0]  # values an HF row holds
        rows = self.tensor.read_rows(first // row, last // row + 1).reshape(-1)
        view = np.lib.stride_tricks.as_strided(rows[first - first // row * row:], lengths,
                                               [st * rows.itemsize for st in strides], writeable=False)
        return np.array(view.transpose(self.perm), dtype=self.target, order="C")
