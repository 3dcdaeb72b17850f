"""The persistent XLA compilation cache: compile each step program once per machine.

Warm-up compiles one program per shape bucket (seconds each on CPU, more for big models);
with the cache a restart loads them from disk instead. The CLI turns it on (or off, for
`--compile-cache none`) and hands its choice to the Engine it builds; an Engine left at
`compile_cache="default"` turns it on unless jax's cache is already configured, and one
given `compile_cache=None` turns it off (engine/engine.py).
"""

from __future__ import annotations

import contextlib
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


def use_compile_cache(choice: str | None = "default") -> str | None:
    """The Engine's default: turn the persistent cache on unless jax already has one (the
    CLI's --compile-cache, JAX_COMPILATION_CACHE_DIR, a notebook's own setting). None: off,
    for this process."""
    import jax

    if choice is None:
        return enable_compile_cache("none")
    configured = jax.config.jax_compilation_cache_dir
    if configured and choice == "default":
        return configured
    return enable_compile_cache(None if choice == "default" else choice)


@contextlib.contextmanager
def count_cache_hits():
    """{"requests": n, "hits": m} of the persistent cache while the block runs (jax's own
    monitoring events), so warm-up can say whether it loaded or compiled."""
    from jax._src import monitoring

    counts = {"requests": 0, "hits": 0}
    names = {"/jax/compilation_cache/compile_requests_use_cache": "requests",
             "/jax/compilation_cache/cache_hits": "hits"}

    def listen(event: str, **kwargs) -> None:
        if event in names:
            counts[names[event]] += 1

    monitoring.register_event_listener(listen)
    try:
        yield counts
    finally:
        monitoring.unregister_event_listener(listen)


def warmup_summary(loaded: int, compiled: int, seconds: float) -> str:
    """'loaded 3 program(s) from the compile cache in 2.1 s' / 'compiled 3 program(s) in ...'."""
    parts = []
    if loaded:
        parts.append(f"loaded {loaded} program(s) from the compile cache")
    if compiled:
        parts.append(f"compiled {compiled} program(s)")
    return (", ".join(parts) or "nothing to compile") + f" in {seconds:.1f} s"
