import gc
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
# XLA:CPU's fusion emitters (jaxlib 0.10's default) spend compile time that these tiny
# programs never win back: tests/test_lfm2_layouts.py took 80 instead of 96 CPU seconds
# without them, one engine build 2-3 instead of 4-5 (2026-12-06, loaded 2-core machine).
# jaxlib 0.11.2 has no such flag and aborts on it, so only 0.10 gets it. Subprocesses
# inherit it through tests/xla_flags.py.
from importlib.metadata import version  # noqa: E402

if version("jaxlib").startswith("0.10.") and "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_use_fusion_emitters=false").strip()
# The engine's own XLA:CPU default (engine/cpu_flags.py: no YNNPACK fusions), set for the
# whole run, so every test process compiles as a user's engine does whichever test starts
# jax first; subprocesses inherit it.
from jaxfill.engine.cpu_flags import set_cpu_xla_flags  # noqa: E402

set_cpu_xla_flags()

# Engines and models built with attention_impl "auto" serve the reference impl here
# (pallas_kernels/ragged_paged_attention AUTO_IMPL_ENV; subprocesses inherit it): on XLA:CPU
# a tiny_random step program compiles in 1.3 s with it against 7.3 s with the blocked xla
# loop (2026-12-07), and step compiles are most of the suite's time. The xla impl is held
# to the float64 oracle directly (test_attention_oracle, _chunked, _diagonal_split,
# _kernels, ...), and the files marked `xla_attention` serve it end to end.
os.environ.setdefault("JAXFILL_ATTENTION_IMPL", "reference")

# In-process tests run on exactly one CPU device, whatever the core count (the Engine
# would otherwise ask for one per core, engine/cpu_devices.py). A jax config, not an
# environment variable: subprocess tests choose their own devices (XLA_FLAGS, or the
# Engine's default) and must not inherit this. It takes precedence over XLA_FLAGS.
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 1)
# The pytest processes themselves never use the persistent cache (their subprocesses,
# which compile the big step programs, still share it): one source of native crashes
# less in the long-lived workers (see _free_compiled_programs).
jax.config.update("jax_enable_compilation_cache", False)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drops every compiled program after each test file. An XLA:CPU executable keeps ~3
    memory mappings of JIT code until it is freed; a worker that ran ~800 tests of a cold
    suite held ~20,000, climbing ~80 a second, towards the kernel's vm.max_map_count
    (65,530), where mmap fails: the likely cause of the native crashes of the cold runs
    of 2026-12-02 and of CI (XLA segfaulting in executable.serialize(), aborting in
    compile, each time in a worker hundreds of tests old). Measured: clear_caches frees
    them (300 small programs: 436 -> 1399 -> 520 maps)."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    """Random-init HF checkpoints, f32, written once per session: {"llama": dir, ...}."""
    from hf_models import ARCHS, make_hf_checkpoint

    root = tmp_path_factory.mktemp("hf")
    return {arch: make_hf_checkpoint(str(root / arch), arch) for arch in ARCHS}


@pytest.fixture(autouse=True, scope="module")
def _xla_attention_where_marked(request):
    """Files marked `xla_attention` (pytestmark) serve what "auto" picks for a user on CPU.
    Module scope: autouse fixtures start first within their scope, so the files'
    module-scoped engines see it too (a marked test function: _xla_attention_test)."""
    if not request.node.get_closest_marker("xla_attention"):
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JAXFILL_ATTENTION_IMPL", "xla")
        yield


@pytest.fixture(autouse=True)
def _xla_attention_test(request, monkeypatch):
    """A test function marked `xla_attention` (its own models, no module-scoped engine)."""
    if request.node.get_closest_marker("xla_attention"):
        monkeypatch.setenv("JAXFILL_ATTENTION_IMPL", "xla")
