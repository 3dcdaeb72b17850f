"""The disk tier's file format (engine/kv_tier/disk.py): one KV block, or one hybrid's
state snapshot, per file.

    b"JFKV1\\n" | u32 header length | header JSON | payload bytes

The header holds the engine's fingerprint (`fingerprint`: model, weights, dtype, page
size, layout), the arrays' shapes and dtypes and a blake2b checksum of the payload. A KV
block's header also holds its parent hash and tokens (a restart's KV events), and its
payload is values then scales. A state snapshot's header says `"kind": "state"` and lists
its arrays (recurrent, then conv: engine/kv_tier/host.py StateSnapshot); it lives in a file
named by its snapshot key (its page's hash + b"state"), so it is found only through the
page hash chain of the prefix it belongs to. `decode` refuses anything not whole, not
ours, or not what was written.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct

import numpy as np

from jaxfill.engine.kv_tier.host import KVBlock, StateSnapshot

MAGIC = b"JFKV1\n"


def fingerprint(config, layout: dict) -> str:
    """What must match for a file's K/V to be valid here: the model (its config, and the
    checkpoint's files or the random-init seed), the cache dtype, the page size and layout."""
    parts = {"model": repr(config.model), "page_size": config.engine.page_size,
             "kv_cache_dtype": config.engine.kv_cache_dtype, "layout": layout}
    if config.model_path:
        files = sorted(f for f in os.listdir(config.model_path) if f.endswith((".safetensors", ".json")))
        parts["checkpoint"] = [(f, os.path.getsize(os.path.join(config.model_path, f)),
                                int(os.path.getmtime(os.path.join(config.model_path, f)))) for f in files]
    return hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=16).hexdigest()


def _spec(a: np.ndarray | None) -> list | None:
    return None if a is None else [list(a.shape), a.dtype.name]


def encode(block: KVBlock | StateSnapshot, fp: str) -> bytes:
    if isinstance(block, StateSnapshot):
        arrays = [block.recurrent, block.conv]
        header = {"fingerprint": fp, "kind": "state", "arrays": [_spec(a) for a in arrays]}
    else:
        arrays = [block.values] + ([] if block.scales is None else [block.scales])
        header = {"fingerprint": fp, "parent": None if block.parent is None else block.parent.hex(),
                  "tokens": list(block.tokens), "values": _spec(block.values), "scales": _spec(block.scales)}
    payload = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    header["checksum"] = hashlib.blake2b(payload, digest_size=16).hexdigest()
    head = json.dumps(header).encode()
    return MAGIC + struct.pack("<I", len(head)) + head + payload


def read_header(f) -> dict:
    if f.read(len(MAGIC)) != MAGIC:
        raise ValueError("not a jaxfill KV block file")
    (n,) = struct.unpack("<I", f.read(4))
    return json.loads(f.read(n))


def _dtype(name: str) -> np.dtype:
    import ml_dtypes  # noqa: F401  registers bfloat16 / float8 names with numpy (a jax dependency)

    return np.dtype(getattr(ml_dtypes, name, name))


def _arrays(payload: bytes, specs: list) -> list:
    """The arrays `specs` describe, in order, from the payload (ValueError past its end)."""
    arrays, at = [], 0
    for spec in specs:
        if spec is None:
            arrays.append(None)
            continue
        shape, dtype = tuple(spec[0]), _dtype(spec[1])
        n = int(np.prod(shape)) * dtype.itemsize
        if at + n > len(payload):
            raise ValueError("truncated")
        arrays.append(np.frombuffer(payload, dtype, count=int(np.prod(shape)), offset=at).reshape(shape).copy())
        at += n
    if at != len(payload):
        raise ValueError("payload longer than its arrays")
    return arrays


def decode(data: bytes, fp: str) -> KVBlock | StateSnapshot:
    """The block (or snapshot) in `data`; ValueError if it is not whole, not ours, or not
    what was written."""
    f = io.BytesIO(data)
    header = read_header(f)
    if header.get("fingerprint") != fp:
        raise ValueError("written by another model or layout")
    payload = f.read()
    if hashlib.blake2b(payload, digest_size=16).hexdigest() != header["checksum"]:
        raise ValueError("checksum mismatch")
    if header.get("kind") == "state":
        specs = header["arrays"]
        if len(specs) != 2 or None in specs:
            raise ValueError("a state snapshot holds a recurrent and a conv array")
        recurrent, conv = _arrays(payload, specs)
        return StateSnapshot(recurrent, conv)
    values, scales = _arrays(payload, [header["values"], header["scales"]])
    parent = None if header["parent"] is None else bytes.fromhex(header["parent"])
    return KVBlock(values, scales, parent, tuple(header["tokens"]))
