"""The device mesh from the [mesh] config section, and multi-process initialisation.

    initialize_distributed(settings)   # once per process, before any other jax call
    mesh = make_mesh(settings)         # axes ('data', 'stage', 'tensor', 'expert', 'sequence'), AxisType.Auto

Axes are AxisType.Auto: model code only names logical axes and adds sharding constraints;
XLA's partitioner inserts the collectives (an Explicit mesh would make every matmul over
a sharded contracting dim spell out its out_sharding).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from jaxfill.models.config import ConfigError

AXES = ("stage", "data", "tensor", "expert", "sequence")  # the devices' order: stage outermost
# The mesh's axis-name order: 'data' before 'stage'. The data-parallel forward is a
# shard_map over 'data' with the pipeline's over 'stage' inside it, and jax >= 0.11.2
# (Shardy) aborts unless the manual axes of nested shard_maps come in mesh-axis order
# ("Manual axes must be sorted by mesh axis index"). The devices stay stage-major.
MESH_ORDER = ("data", "stage", "tensor", "expert", "sequence")


def initialize_distributed(settings) -> bool:
    """jax.distributed.initialize for multi-process runs; returns True if it initialised.

    * mesh.coordinator="host:port" with mesh.num_processes > 1: explicit (CPU/GPU clusters,
      tests with two processes on 127.0.0.1). On CPU the gloo collectives are selected.
    * no coordinator but a TPU pod / cluster environment (TPU_WORKER_HOSTNAMES with more
      than one host, MEGASCALE_COORDINATOR_ADDRESS, JAX_COORDINATOR_ADDRESS, SLURM_JOB_ID,
      OMPI_COMM_WORLD_SIZE): jax.distributed.initialize() auto-detects.
    * otherwise single process: nothing to do.
    Must run before any jax computation or device query in the process.
    """
    import jax

    if jax.distributed.is_initialized():
        return False
    if settings.coordinator and settings.num_processes > 1:
        # Only affects the CPU backend (cross-process CPU collectives); harmless elsewhere.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=settings.coordinator,
                                   num_processes=settings.num_processes,
                                   process_id=settings.process_id)
        return True
    # num_processes > 1 with neither a coordinator nor a cluster: refused by engine/validation.py
    if cluster_env():
        jax.distributed.initialize()
        return True
    return False


def cluster_env() -> bool:
    env = os.environ
    hosts = env.get("TPU_WORKER_HOSTNAMES", "")
    return bool(("," in hosts) or env.get("MEGASCALE_COORDINATOR_ADDRESS")
                or env.get("JAX_COORDINATOR_ADDRESS")
                or (env.get("SLURM_JOB_ID") and int(env.get("SLURM_NTASKS", "1")) > 1)
                or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1)


def ordered_devices(devices=None) -> list:
    """All global devices, process-major (each process's devices contiguous, by id within
    a process). Global ids are not contiguous across processes (e.g. 0-3 and 131072-...),
    so ordering by process first keeps the innermost mesh axes inside one host."""
    import jax

    devices = list(devices if devices is not None else jax.devices())
    return sorted(devices, key=lambda d: (d.process_index, d.id))


def make_mesh(settings, devices=None):
    """jax.sharding.Mesh with axes MESH_ORDER of the configured sizes.

    The product must equal the number of devices (all processes together). Device order:
    TPU single-process uses jax.make_mesh (topology-aware); otherwise process-major order,
    so with several hosts the outermost axis of AXES larger than one spans hosts: 'stage' (one
    pipeline stage per host, activations cross the slow link once per stage), else 'data',
    else 'tensor'.
    """
    import jax
    from jax.sharding import AxisType

    devices = ordered_devices(devices)
    shape = tuple(int(getattr(settings, axis)) for axis in AXES)
    if int(np.prod(shape)) != len(devices):
        kinds = sorted({d.platform for d in devices})
        raise ConfigError(
            "mesh " + " x ".join(f"{a}={n}" for a, n in zip(AXES, shape)) + f" = "
            f"{int(np.prod(shape))} devices, but {len(devices)} {'/'.join(kinds)} device(s) are visible across "
            f"{jax.process_count()} process(es); set mesh.* so the product is {len(devices)}"
            + (" (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N sets the device count; "
               "with every mesh.* at 1 the engine splits the heads over the CPU devices itself)"
               if kinds == ["cpu"] else ""))
    types = (AxisType.Auto,) * len(AXES)
    if devices[0].platform == "tpu" and jax.process_count() == 1:
        grid = jax.make_mesh(shape, AXES, axis_types=types, devices=devices).devices
    else:
        grid = np.array(devices, dtype=object).reshape(shape)
    order = [AXES.index(a) for a in MESH_ORDER]
    return jax.sharding.Mesh(grid.transpose(order), MESH_ORDER, axis_types=types)


def with_mesh_shape(config, mesh):
    """`config` whose mesh.* sizes are `mesh`'s (None: one device, as configured), so that
    what reads config.mesh (logs, GetModelInfo, the planner) sees the CPU split's tensor."""
    if mesh is None:
        return config
    sizes = {axis: int(size) for axis, size in dict(mesh.shape).items()}
    return dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, **sizes))
