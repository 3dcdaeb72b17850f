"""jaxfill: a JAX/XLA LLM inference engine built around prefill.

The repository's top-level folders install as `jaxfill.engine`, `jaxfill.models`,
`jaxfill.pallas_kernels`, `jaxfill.serving` and `jaxfill.configs`; this file is the
package root and holds the public API.
"""

from jaxfill.engine.config import load_config
from jaxfill.engine.cpu_devices import use_cpu_cores
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams

__all__ = ["Engine", "SamplingParams", "load_config", "use_cpu_cores"]
