"""The activation peak of a lowered step program, remembered beside the compile cache.

Sizing the pool (engine/memory.py) needs XLA's temp-buffer bytes for the largest bucket,
which only a compiled executable reports. On XLA:CPU a warm start still paid for it: the
executable comes back from jax's persistent cache by a deserialization that took 20-27 s
of SmolLM2-135M's ~69 s warm `generate` (an 8192 x 64 bucket, profiled 2026-12-07) for one
integer. The integer is kept instead, in one small JSON file in the compile cache
directory; with the cache off nothing is kept or read.

The key is what decides the program without building it: the jaxfill source, the resolved
config, the abstract arguments (shapes, dtypes, shardings), the jax / jaxlib versions,
the device kind and the JAX_* / XLA_* environment. Keying by the lowered program's text
instead (the first version) still traced and lowered the largest bucket on every start:
5-9 s of a warm SmolLM2 start (cProfile, 2026-12-07) for a bucket `generate` never runs.
A stale entry could only misjudge the pool's size, and any edit to the source, the config
or the versions misses.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile

import jax
import jaxlib

FILE = "jaxfill_activation_peaks.json"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the jaxfill package
MAX_ENTRIES = 256  # newest kept: one per (model, largest bucket, mesh) a user runs


def _path() -> str | None:
    directory = jax.config.jax_compilation_cache_dir
    return os.path.join(directory, FILE) if directory else None


@functools.cache
def source_digest() -> str:
    """sha256 of every .py file of the jaxfill package (read once a process: ~400 small files)."""
    digest = hashlib.sha256()
    for directory, dirs, files in sorted(os.walk(ROOT)):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in ("tests", "benchmarks", "__pycache__"))
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(directory, name)
            digest.update(os.path.relpath(path, ROOT).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


def _abstract(tree) -> str:
    """The tree's structure and each leaf's shape, dtype and sharding, as text."""
    leaves, treedef = jax.tree.flatten(tree)
    parts = [f"{getattr(x, 'shape', ())}:{getattr(x, 'dtype', type(x).__name__)}:{getattr(x, 'sharding', '')}"
             for x in leaves]
    return f"{treedef}\n" + "\n".join(parts)


def program_key(config, *args) -> str:
    """The key of the step program `config` runs on `args` (its arguments: weights, cache,
    batch, ...), computed without tracing it."""
    device = jax.devices()[0]
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(("JAX_", "XLA_")))
    text = "\n".join([f"{jax.__version__} {jaxlib.__version__} {device.platform} {device.device_kind}",
                      source_digest(), repr(config), repr(env), *(_abstract(a) for a in args)])
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
