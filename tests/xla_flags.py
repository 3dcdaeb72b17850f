"""XLA_FLAGS for the suite's subprocesses: N fake CPU devices, plus the compile-time flag
conftest.py sets for the whole run. A subprocess that set XLA_FLAGS to its device count
alone would drop that flag and compile slower than its parent."""

import os

DEVICE_COUNT = "--xla_force_host_platform_device_count"


def fake_devices(n: int) -> str:
    """XLA_FLAGS value: this process's flags (device count removed) and `n` CPU devices."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT)]
    return " ".join(kept + [f"{DEVICE_COUNT}={n}"])
