"""Accelerator specs for the prefill planner: vendor figures from configs/hardware.toml,
or this machine's CPU measured on the spot (`cpu`).

A `Hardware` is per device (one GPU, one TPU chip). The planner divides work over the
mesh and asks each device for max(FLOPs / peak, bytes / bandwidth) plus collectives.
"""

from __future__ import annotations

import dataclasses
import os
import time
import tomllib

from importlib import resources


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    bf16_flops: float  # dense matmul peak, FLOP/s per device
    fp32_flops: float  # f32 matmul at JAX's DEFAULT precision, FLOP/s per device
    hbm_bytes: float  # device memory
    hbm_bytes_per_s: float  # device memory bandwidth
    link_bytes_per_s: float  # chip-to-chip, one direction (0: no interconnect)
    source: str
    # True for `cpu`: fake XLA devices (--xla_force_host_platform_device_count) split the
    # same cores and memory, so the planner divides the figures by the mesh size.
    shared_by_mesh: bool = False

    def peak_flops(self, dtype: str) -> float:
        return self.fp32_flops if dtype == "float32" else self.bf16_flops

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _norm(name: str) -> str:
    return name.strip().lower().replace("-", "_").replace(" ", "_")


def hardware_table(path: str | None = None) -> dict[str, dict]:
    """configs/hardware.toml (read from the installed package) or the TOML at `path`."""
    if path is None:
        return tomllib.loads(resources.files("jaxfill.configs").joinpath("hardware.toml").read_text())
    with open(path, "rb") as f:
        return tomllib.load(f)


def hardware_names(path: str | None = None) -> list[str]:
    return sorted(hardware_table(path)) + ["cpu"]


def hardware_help(path: str | None = None) -> str:
    """'h100_sxm (also: h100, h100-sxm), h200, ..., cpu': the names --hardware takes."""
    names = []
    for entry, spec in sorted(hardware_table(path).items()):
        aliases = spec.get("aliases", ())
        names.append(f"{entry} (also: {', '.join(aliases)})" if aliases else entry)
    return ", ".join(names + ["cpu (measured now)"])


def load_hardware(name: str, dtype: str = "bfloat16", matmul_shape: tuple[int, int, int] | None = None,
                  path: str | None = None) -> Hardware:
    """A named entry of configs/hardware.toml, or `cpu` (measured now at `dtype`)."""
    key = _norm(name)
    if key == "cpu":
        return measure_cpu(dtype, matmul_shape)
    table = hardware_table(path)
    for entry, spec in table.items():
        if key == _norm(entry) or key in (_norm(a) for a in spec.get("aliases", ())):
            fields = {f.name for f in dataclasses.fields(Hardware)}
            values = {k: v for k, v in spec.items() if k in fields}
            return Hardware(name=entry, **{k: (float(v) if k not in ("description", "source") else v)
                                           for k, v in values.items()})
    raise ValueError(f"unknown hardware {name!r}; known: {', '.join(hardware_names(path))}")


# ----------------------------------------------------------------------------- cpu
def _best_time(fn, *args, repeats: int = 5, feed_back: bool = False) -> float:
    """Fastest seconds of fn(*args) over `repeats`: a floor needs the machine's best rate,
    and on a shared machine the median under-measures it (a measured TTFT then fell below
    the "floor", 0.80x); with feed_back, the output replaces args[0] (donated)."""
    out = fn(*args).block_until_ready()  # compile + warm
    times = []
    for _ in range(repeats):
        if feed_back:
            args = (out,) + args[1:]
        start = time.perf_counter()
        out = fn(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return min(times)


class MatmulProbe:
    """XLA matmul [M, K] @ [K, N] FLOP/s on the default device, compiled once, so it can be
    called between benchmark runs to track how much of a shared machine is ours right now."""

    def __init__(self, dtype: str = "float32", shape: tuple[int, int, int] = (2048, 2048, 2048)):
        import jax
        import jax.numpy as jnp

        m, k, n = shape
        dt = getattr(jnp, dtype)
        ka, kb = jax.random.split(jax.random.key(0))
        self.a = jax.random.normal(ka, (m, k), jnp.float32).astype(dt)
        self.b = jax.random.normal(kb, (k, n), jnp.float32).astype(dt)
        # f32 accumulation, as the model's matmuls (bf16 operands, f32 accumulate on CPU).
        self.fn = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(dt))
        self.flops = 2.0 * m * k * n

    def __call__(self, repeats: int = 5) -> float:
        return self.flops / _best_time(self.fn, self.a, self.b, repeats=repeats)


def measure_matmul_flops(dtype: str = "float32", shape: tuple[int, int, int] = (2048, 2048, 2048),
                         repeats: int = 5) -> float:
    """XLA matmul [M, K] @ [K, N] FLOP/s on the default device (best of `repeats`)."""
    return MatmulProbe(dtype, shape)(repeats)


def measure_memory_bandwidth(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Bytes/s of a jitted streaming scale (read + write of an `nbytes` f32 array).

    The input is donated and the output fed back, so the buffer is reused: a fresh
    output per call would time page faults (~1 GB/s in a VM), not memory bandwidth.
    """
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 4,), jnp.float32)
    scale = jax.jit(lambda x: x * jnp.float32(1.0001), donate_argnums=0)
    return 2.0 * nbytes / _best_time(scale, x, repeats=repeats, feed_back=True)


def measure_cpu(dtype: str = "float32", matmul_shape: tuple[int, int, int] | None = None) -> Hardware:
    """This machine, measured now: XLA matmul FLOP/s at `dtype` (at `matmul_shape`, by
    default 2048^3; the planner passes the model's MLP shape) and streaming bandwidth."""
    shape = tuple(matmul_shape or (2048, 2048, 2048))
    flops = measure_matmul_flops(dtype, shape)
    bw = measure_memory_bandwidth()
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 0
    shape_txt = "x".join(str(s) for s in shape)
    return Hardware(
        name="cpu", description=f"this machine ({os.cpu_count()} cores), measured",
        bf16_flops=flops, fp32_flops=flops, hbm_bytes=float(mem), hbm_bytes_per_s=bw,
        link_bytes_per_s=bw,  # fake devices exchange data through the same memory
        source=f"measured {time.strftime('%Y-%m-%d %H:%M')}: XLA {dtype} matmul {shape_txt} best of 5, "
               f"64 MiB streaming scale best of 5",
        shared_by_mesh=True,
    )
