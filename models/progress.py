"""Progress bars and start-up noise: what a new user sees before the first token.

`progress_bar` is tqdm's notebook widget where ipywidgets is installed, else the plain
text bar (tqdm.auto would warn "IProgress not found" in such a notebook).
`quiet_backend_probe` drops jax's "Unable to initialize backend 'tpu'" line when it only
says that libtpu is not installed, i.e. on a machine with no TPU.
"""

from __future__ import annotations

import importlib.util
import logging


def progress_bar(iterable, **kwargs):
    """tqdm(iterable, **kwargs) in the best form this process can show."""
    if importlib.util.find_spec("ipywidgets") is not None:
        from tqdm.auto import tqdm
    else:
        from tqdm.std import tqdm
    return tqdm(iterable, **kwargs)


class _NoMissingLibtpu(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not (text.startswith("Unable to initialize backend 'tpu'") and "libtpu" in text)


def quiet_backend_probe() -> None:
    """Idempotent: one filter on jax's backend logger."""
    logger = logging.getLogger("jax._src.xla_bridge")
    if not any(isinstance(f, _NoMissingLibtpu) for f in logger.filters):
        logger.addFilter(_NoMissingLibtpu())
