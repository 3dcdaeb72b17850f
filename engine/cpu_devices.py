"""One XLA CPU device per core, and the default mesh's heads split over them.

XLA:CPU runs one device's program on a thread pool but spreads the attention loop's
small per-tile ops poorly over it, while two devices' programs run side by side: on a
2-core host, prefill with the heads over 2 CPU devices (mesh.tensor=2) was 7-13% faster
than one device (benchmarks/RESULTS.md, "CPU speed vs PyTorch (issue 17)"). So by
default the Engine asks jax for one CPU device per core before jax's backends start
(`use_cpu_cores`), and a default one-device mesh becomes mesh.tensor = t over the first
t CPU devices, t the most the model's heads split over (`cpu_split_mesh`).

    import jax
    import jaxfill
    jaxfill.use_cpu_cores()   # in a notebook: right after `import jax`, before any jnp call

On a GPU/TPU host this changes only the CPU backend's device count: jax's default
backend is the initialised platform with the highest registration priority (jax 0.10.2,
jax/_src/xla_bridge.py `backends()`: cpu registers with priority 0, tpu 300, PJRT plugins
such as GPU 400 unless they say otherwise), and the number of devices a backend has
plays no part in that choice (read from the code; no accelerator host was tried).
"""

from __future__ import annotations

import dataclasses
import logging
import os

log = logging.getLogger("jaxfill.cpu")

FORCE_FLAG = "--xla_force_host_platform_device_count"
HINT = ("call jaxfill.use_cpu_cores() right after `import jax`, before anything runs on jax, "
        "for one XLA CPU device per core")


def num_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. under taskset), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def user_chose_cpu_devices() -> bool:
    """The CPU device count was set already: XLA_FLAGS or jax_num_cpu_devices."""
    import jax

    return FORCE_FLAG in os.environ.get("XLA_FLAGS", "") or jax.config.jax_num_cpu_devices != -1


def backends_started() -> bool:
    """jax's backends exist (a device query or computation ran): the CPU device count is fixed."""
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # a private API: assume started, so nothing is changed
        return True


def cpu_platform_allowed() -> bool:
    """JAX_PLATFORMS unset, or it names cpu."""
    import jax

    platforms = jax.config.jax_platforms
    return not platforms or "cpu" in [p.strip() for p in platforms.split(",")]


def use_cpu_cores(settings=None, dtype: str = "float32") -> int | None:
    """Asks jax for one CPU device per core; returns that count, or None when it left jax
    alone: mesh.cpu_split is false, the user chose a count, the backends already started,
    a multi-process run (mesh.num_processes > 1, a cluster environment, jax.distributed
    up: each process's device count is part of the global mesh), JAX_PLATFORMS without
    cpu, or one core. `settings`: the [mesh] (MeshSettings; None: the defaults). Call
    before anything touches jax's devices; the Engine and the CLI do. It also sets the
    engine's XLA:CPU flags (engine/cpu_flags.py, which depend on `dtype`, model.dtype), which
    only take effect then."""
    import jax

    from jaxfill.engine.cpu_flags import set_cpu_xla_flags
    from jaxfill.engine.mesh import cluster_env
    from jaxfill.models.progress import quiet_backend_probe

    quiet_backend_probe()  # before jax probes its backends
    if not backends_started() and cpu_platform_allowed():
        set_cpu_xla_flags(dtype)  # engine/cpu_flags.py: read when the CPU backend starts, whatever the device count
    if settings is not None and (settings.num_processes > 1 or not settings.cpu_split):
        return None
    cores = num_cores()
    if (cores <= 1 or user_chose_cpu_devices() or not cpu_platform_allowed() or backends_started()
            or cluster_env() or jax.distributed.is_initialized()):
        return None
    jax.config.update("jax_num_cpu_devices", cores)
    return cores


def split_tensor(model, settings, num_devices: int) -> int:
    """The largest t <= num_devices the model's heads (and MLP) split over, by the
    mesh check (engine/validation.py check_mesh)."""
    from jaxfill.engine.validation import check_mesh

    for t in range(num_devices, 1, -1):
        try:
            check_mesh(model, dataclasses.replace(settings, tensor=t))
        except ValueError:
            continue
        return t
    return 1


def cpu_split_mesh(model, settings):
    """The mesh for a default one-device [mesh] on a single-process CPU host: tensor = t
    over the first t CPU devices, or None (one device) when t is 1, mesh.cpu_split is
    false, or there is one CPU device. Logs the choice, or how to get more devices."""
    import jax

    from jaxfill.engine.mesh import make_mesh, ordered_devices

    if settings.size != 1 or jax.process_count() != 1 or jax.default_backend() != "cpu":
        return None
    devices = ordered_devices()
    n, cores = len(devices), num_cores()
    if n == 1:
        if settings.cpu_split and cores > 1 and not user_chose_cpu_devices():
            log.warning("CPU: one XLA CPU device on %d cores (jax started before jaxfill could add "
                        "devices); %s", cores, HINT)
        return None
    if not settings.cpu_split:
        log.info("CPU: one of %d XLA CPU devices (mesh.cpu_split=false)", n)
        return None
    if str(model.dtype) == "bfloat16":
        # jax 0.10.2 and 0.11.2, measured 2026-12-03: compiling the split's bf16 all-reduces
        # aborts the process (AllReducePromotion: "Invalid binary instruction opcode copy").
        log.info("CPU: one of %d XLA CPU devices: XLA:CPU aborts compiling a bf16 model's all-reduces "
                 "(f32 and f16 models split)", n)
        return None
    t = split_tensor(model, settings, n)
    if t == 1:
        log.info("CPU: one of %d XLA CPU devices: the model's heads (%d, %d KV) or MLP (%d) do not "
                 "split over 2 or more", n, model.num_heads, model.num_kv_heads, model.intermediate_size)
        return None
    where = (f"{t} XLA CPU devices, one per core" if t == n == cores
             else f"{t} of {n} XLA CPU devices ({cores} cores)")
    log.info("CPU: heads split over %s (mesh.tensor=%d); set mesh.cpu_split=false for one device", where, t)
    return make_mesh(dataclasses.replace(settings, tensor=t), devices=devices[:t])
