import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/hf_models.py and friends

# XLA:CPU compiles dominate the suite's time and many tests (and their subprocesses,
# which inherit these variables) compile identical programs: share them on disk.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(_ROOT, ".jax_cache"))
# Programs that compile in under a second are not worth a disk entry (see below for why
# the pytest processes themselves never write one).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
# Tests run tiny models, so compiling costs far more than running: skip XLA's LLVM
# optimisations (jax's own switch; subprocesses inherit it). One cold-cache engine test,
# test_kv_quant_engine[float8_e4m3fn]: 70 s -> 57 s; the whole suite, cold cache, 2 workers:
# 38.5 -> 28.7 min.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# In-process tests run on exactly one CPU device, whatever the core count (the Engine
# would otherwise ask for one per core, engine/cpu_devices.py). A jax config, not an
# environment variable: subprocess tests choose their own devices (XLA_FLAGS, or the
# Engine's default) and must not inherit this. It takes precedence over XLA_FLAGS.
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 1)
# The pytest processes themselves never use the persistent cache (their subprocesses,
# which compile the big step programs, still share it): in four cold runs on 2026-12-02
# (three here, one in CI) XLA CPU's executable.serialize() segfaulted in a pytest worker
# after ~800 tests (test_sampler, test_kv_quant_engine) and xdist then hung. Not
# root-caused. A threshold was not enough: in-process `cli.main()` calls re-enable writes
# (engine/compile_cache.py); jax's master switch is not touched by anything we run.
jax.config.update("jax_enable_compilation_cache", False)


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    """Random-init HF checkpoints, f32, written once per session: {"llama": dir, ...}."""
    from hf_models import ARCHS, make_hf_checkpoint

    root = tmp_path_factory.mktemp("hf")
    return {arch: make_hf_checkpoint(str(root / arch), arch) for arch in ARCHS}
