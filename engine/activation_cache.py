"""The activation peak of a lowered step program, remembered beside the compile cache.

Sizing the pool (engine/memory.py) needs XLA's temp-buffer bytes for the largest bucket,
which only a compiled executable reports. On XLA:CPU a warm start still paid for it: the
executable comes back from jax's persistent cache by a deserialization that took 20-27 s
of SmolLM2-135M's ~69 s warm `generate` (an 8192 x 64 bucket, profiled 2026-12-07) for one
integer. The integer is kept instead, keyed by the lowered program's text and the jax /
jaxlib versions and device kind (what decides the executable), in one small JSON file in
the compile cache directory; with the cache off nothing is kept or read.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

import jax
import jaxlib

FILE = "jaxfill_activation_peaks.json"
MAX_ENTRIES = 256  # newest kept: one per (model, largest bucket, mesh) a user runs


def _path() -> str | None:
    directory = jax.config.jax_compilation_cache_dir
    return os.path.join(directory, FILE) if directory else None


def program_key(lowered) -> str:
    device = jax.devices()[0]
    text = f"{jax.__version__} {jaxlib.__version__} {device.platform} {device.device_kind}\n{lowered.as_text()}"
    return hashlib.sha256(text.encode()).hexdigest()


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def remembered(key: str) -> int | None:
    path = _path()
    value = _read(path).get(key) if path else None
    return int(value) if isinstance(value, int) and value >= 0 else None


def remember(key: str, peak: int) -> None:
    """Written whole to a temporary file and renamed over the old one, so concurrent starts
    never read half a file (the last writer wins; a lost entry costs one compile)."""
    path = _path()
    if path is None:
        return
    data = _read(path)
    data.pop(key, None)
    data[key] = int(peak)
    data = dict(list(data.items())[-MAX_ENTRIES:])
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".peaks-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache directory: the peak is measured again next start
