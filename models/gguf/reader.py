"""A GGUF file's header: its metadata and where each tensor's bytes are; no tensor read.

The format (llama.cpp's ggml/docs/gguf.md): "GGUF", a version (2 or 3), the tensor and
key counts, the key/value metadata, then one entry per tensor (name, dims innermost
first, ggml type, offset into the data section), then the data section, aligned to
`general.alignment` (32 unless the file says otherwise). Everything is little-endian.
"""

from __future__ import annotations

import dataclasses
import os
import struct

import numpy as np

from jaxfill.models.config import ConfigError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# Metadata value types -> struct format (8: string, 9: array are read by hand).
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry. `dims` as the file gives them (innermost first);
    `shape` the C-order shape (outermost first), as transformers and numpy see it."""
    name: str
    dims: tuple
    ggml_type: int
    offset: int  # absolute, in the file

    @property
    def shape(self) -> tuple:
        return tuple(reversed(self.dims))


@dataclasses.dataclass(frozen=True)
class GGUFHeader:
    path: str
    metadata: dict
    tensors: dict  # name -> TensorInfo, in file order

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "")


class _Cursor:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def take(self, fmt: str):
        value = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        self.pos += n
        return self.data[self.pos - n:self.pos].decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind in SCALARS:
            return self.take(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item in SCALARS and item != 7:  # numbers: one vectorised read
                dtype = np.dtype(SCALARS[item])
                out = np.frombuffer(self.data, dtype, count, self.pos)
                self.pos += count * dtype.itemsize
                return out.tolist()
            return [self.value(item) for _ in range(count)]
        raise ConfigError(f"GGUF metadata value type {kind} is unknown")


def read_header(path: str) -> GGUFHeader:
    """The file's metadata and tensor table; a file that is not GGUF is a ConfigError."""
    with open(path, "rb") as f:
        data = f.read(_header_bytes(path))
    if data[:4] != MAGIC:
        raise ConfigError(f"{path} is not a GGUF file (magic {data[:4]!r})")
    cursor = _Cursor(data)
    cursor.pos = 4
    version = cursor.take("<I")
    if version not in (2, 3):
        raise ConfigError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_keys = cursor.take("<Q"), cursor.take("<Q")
    metadata = {}
    for _ in range(n_keys):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cursor.string()
        dims = tuple(cursor.take("<Q") for _ in range(cursor.take("<I")))
        infos.append((name, dims, cursor.take("<I"), cursor.take("<Q")))
    align = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-cursor.pos // align) * align
    tensors = {name: TensorInfo(name, dims, kind, start + offset) for name, dims, kind, offset in infos}
    return GGUFHeader(path, metadata, tensors)


def _header_bytes(path: str) -> int:
    """Bytes to read for the header: the whole file up to 64 MiB (a header holding a
    150k-token vocabulary is a few MiB), else 64 MiB."""
    return min(os.path.getsize(path), 64 << 20)
