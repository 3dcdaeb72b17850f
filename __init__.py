"""jaxfill: a JAX/XLA LLM inference engine built around prefill.

The repository's top-level folders install as `jaxfill.engine`, `jaxfill.models`,
`jaxfill.pallas_kernels`, `jaxfill.serving` and `jaxfill.configs`; this file is the
package root and holds the public API.
"""

import importlib

# The public API, imported on first use (PEP 562) so that `import jaxfill.serving.cli`
# (every `jaxfill` command, `--help` included) does not pay for importing jax.
_PUBLIC = {"Engine": "jaxfill.engine.engine", "SamplingParams": "jaxfill.engine.request",
           "StructuredOutput": "jaxfill.engine.request",
           "load_config": "jaxfill.engine.config", "use_cpu_cores": "jaxfill.engine.cpu_devices"}

__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jaxfill' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
