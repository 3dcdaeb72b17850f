"""GGUF checkpoints (llama.cpp's single-file format): `--model file.gguf`, or a directory
holding one GGUF and no config.json.

reader.py parses the header, quants.py dequantizes ggml's blocks, arch.py derives the HF
config and tensor names transformers would, tensors.py reads a tensor's rows into the
loader of models/checkpoint.py. A file whose projections are all of quantized types (the
32-value ones and the k-quants, llama.cpp's per-layer mixes included) keeps them packed
(int_codes.py: model.weight_dtype = int_group, its default; each projection in its own
form); every other tensor, and every tensor of files with float projections or of
weight_dtype auto / int8, is dequantized at load to the model's dtype (or re-quantized to
int8 with model.weight_dtype=int8).
"""

from __future__ import annotations

import functools
import glob
import os
from typing import Iterator

from jaxfill.models.config import ConfigError
from jaxfill.models.gguf.arch import hf_config, hf_name, row_order
from jaxfill.models.gguf.reader import GGUFHeader, read_header
from jaxfill.models.gguf.tensors import GGUFSlices, GGUFTensor

__all__ = ["GGUFHeader", "GGUFSlices", "GGUFTensor", "gguf_file", "header", "hf_config_of", "tensors"]


def gguf_file(model_path: str | os.PathLike | None) -> str | None:
    """The GGUF a model path names: the path itself when it ends in .gguf, or the one .gguf
    of a directory without config.json; None for anything else (a safetensors directory)."""
    if not model_path:
        return None
    path = os.fspath(model_path)
    if os.path.isfile(path) and path.lower().endswith(".gguf"):
        return path
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "config.json")):
        return None
    found = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(found) > 1:
        raise ConfigError(f"{path} holds {len(found)} GGUF files ({', '.join(map(os.path.basename, found))}): "
                          "pass --model with the one to load")
    return found[0] if found else None


def header(path: str) -> GGUFHeader:
    """The file's header, read once per file version."""
    stat = os.stat(path)
    return _header(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _header(path: str, mtime: int, size: int) -> GGUFHeader:
    return read_header(path)


def hf_config_of(path: str) -> dict:
    return hf_config(header(path))


def tensors(path: str) -> Iterator[tuple[str, GGUFTensor]]:
    """(HF name, reader) per tensor of the file, nothing read yet."""
    head = header(path)
    config = hf_config(head)
    for name, info in head.tensors.items():
        rows = info.shape[0] if len(info.shape) > 1 else 1
        yield hf_name(name), GGUFTensor(head.path, info, row_order(name, config, rows))
