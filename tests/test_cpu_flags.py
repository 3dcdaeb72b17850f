"""engine/cpu_flags.py: the engine starts XLA:CPU without YNNPACK fusions (their executables
load from the compile cache quadratically slowly), unless the user's XLA_FLAGS says otherwise
or the model computes in bfloat16 (YNNPACK's dots are its avx512_bf16 rate)."""

import subprocess
import sys

import jaxlib
import pytest

from jaxfill.engine.cpu_flags import FLAG_VERSIONS, YNN_FLAG, set_cpu_xla_flags

# A fresh process: jaxfill's Engine start-up call (use_cpu_cores) before jax's backend starts,
# then how many YNN fusions a small matmul program compiles to.
PROBE = """
import os, sys
os.environ["XLA_FLAGS"] = sys.argv[1]
import jax, jax.numpy as jnp
from jaxfill.engine.cpu_devices import use_cpu_cores
if sys.argv[2].startswith("engine"):
    use_cpu_cores(None, "bfloat16" if sys.argv[2] == "engine_bf16" else "float32")
f = jax.jit(lambda a, b: jnp.tanh(a @ b) + 1)
text = f.lower(jnp.ones((64, 128)), jnp.ones((128, 32))).compile().as_text()
print(os.environ.get("XLA_FLAGS", ""), "|", text.count("__ynn_fusion"))
"""

needs_flag = pytest.mark.skipif(not jaxlib.__version__.startswith(FLAG_VERSIONS),
                                reason=f"jaxlib {jaxlib.__version__} is not read to have {YNN_FLAG}")


def probe(flags: str, mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, flags, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    env, count = out.stdout.strip().rsplit("|", 1)
    return env.strip(), int(count)


@needs_flag
def test_the_engine_starts_xla_cpu_without_ynn_fusions():
    env, count = probe("", "engine")
    assert f"{YNN_FLAG}=" in env and count == 0
    assert probe("", "plain")[1] > 0  # jax's own default has them: the probe can tell


@needs_flag
def test_the_users_flag_wins():
    env, count = probe(f"{YNN_FLAG}=dot", "engine")
    assert env == f"{YNN_FLAG}=dot" and count > 0


def test_set_only_once_and_beside_other_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    added = set_cpu_xla_flags()
    assert added == jaxlib.__version__.startswith(FLAG_VERSIONS)
    flags = __import__("os").environ["XLA_FLAGS"]
    assert flags.startswith("--xla_force_host_platform_device_count=2")
    assert not set_cpu_xla_flags() and flags.count(YNN_FLAG) == int(added)


@needs_flag
def test_a_bf16_model_keeps_them():
    env, count = probe("", "engine_bf16")
    assert YNN_FLAG not in env and count > 0


def test_the_cli_reads_the_dtype_of_config_and_overrides(monkeypatch):
    from jaxfill.serving import cli

    seen = []
    monkeypatch.setattr("jaxfill.engine.cpu_devices.use_cpu_cores", lambda settings, dtype: seen.append(dtype))
    for argv in (["generate", "--prompt", "x"], ["generate", "--prompt", "x", "--set", "model.dtype=bfloat16"]):
        cli._use_cpu_cores(cli.build_parser().parse_args(argv))
    assert seen == ["float32", "bfloat16"]
