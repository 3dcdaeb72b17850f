"""The persistent XLA compilation cache: compile each step program once per machine.

Warm-up compiles one program per shape bucket (seconds each on CPU, more for big models);
with the cache a restart loads them from disk instead. The CLI turns it on by default;
in a notebook call `enable_compile_cache()` yourself (it changes process-wide JAX config,
so a library constructor never does it behind your back).
"""

from __future__ import annotations

import os

ENV_VAR = "JAXFILL_COMPILE_CACHE"


def default_cache_dir() -> str:
    """$JAXFILL_COMPILE_CACHE, else JAX's own $JAX_COMPILATION_CACHE_DIR, else the user's cache dir."""
    explicit = os.environ.get(ENV_VAR) or os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxfill", "xla")


def enable_compile_cache(directory: str | None = None) -> str | None:
    """Points JAX's persistent cache at `directory` (None: the default); "none" turns it off.
    Returns the directory in use, or None when off."""
    import jax

    directory = default_cache_dir() if directory is None else directory
    if directory.lower() in ("none", "off", ""):
        jax.config.update("jax_compilation_cache_dir", None)
        return None
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    # Cache every program: the step buckets are small on CPU but still seconds to compile.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return directory
