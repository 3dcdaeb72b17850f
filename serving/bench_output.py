"""Where `jaxfill bench ...` writes, and whether it can draw.

Results go to a fresh directory by default, so a run never overwrites the committed tables
under benchmarks/results/. Plots need matplotlib, an optional extra (`jaxfill[plots]`).
"""

from __future__ import annotations

import os
import time


def fresh_results_dir(kind: str, root: str = "jaxfill-bench") -> str:
    """`jaxfill-bench/<kind>-<UTC time>` under the current directory; never an existing one."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path = os.path.join(root, f"{kind}-{stamp}")
    n = 1
    while os.path.exists(path):
        n += 1
        path = os.path.join(root, f"{kind}-{stamp}-{n}")
    os.makedirs(path)
    return path


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


PLOTS_HINT = "plots need matplotlib: pip install 'jaxfill[plots]'"
