"""engine.num_pages = 0 sizes the KV pool from memory (engine/memory.py): on CPU the pool
matches the documented formula, the planner agrees within one page, a quantized cache
fits more pages by the ratio of page bytes, and impossible settings fail clearly."""

import dataclasses
import os

import pytest

from jaxfill.engine import memory
from jaxfill.engine.config import load_config
from jaxfill.engine.engine import Engine
from jaxfill.engine.planner.hardware import Hardware
from jaxfill.engine.planner.plan import kv_pool_pages
from jaxfill.engine.request import SamplingParams
from jaxfill.models.config import ConfigError
from jaxfill.models.kv_cache import kv_bytes_per_token
from jaxfill.models.quant import param_bytes
from jaxfill.models.families.registry import param_count

SMALL = {"engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64], "engine.max_num_seqs": 4,
         "engine.max_model_len": 256, "engine.num_pages": 0, "engine.memory_utilization": 0.5}
HOST_FREE = 24 << 20  # what /proc/meminfo "says" in these tests: a pool of a few hundred pages


@pytest.fixture
def fake_meminfo(monkeypatch):
    monkeypatch.setattr(memory, "host_memory_available", lambda: HOST_FREE)


def _engine(**extra) -> Engine:
    return Engine(load_config("tiny_random", {**SMALL, **extra}), progress=False, warmup=False)


def _expected_pages(engine: Engine) -> int:
    """The documented CPU formula, from quantities computed here, not read from the pool."""
    c = engine.config
    weights = param_bytes(engine.runner.state)  # one device holds them all
    page = c.engine.page_size * kv_bytes_per_token(c.model.num_layers, c.model.num_kv_heads, c.model.head_dim,
                                                    c.engine.kv_cache_dtype, c.model.jnp_dtype)
    act = engine.runner.pool.activation_bytes
    return int(((HOST_FREE + weights) * c.engine.memory_utilization - weights - act) // page)


@pytest.mark.slow
def test_cpu_pool_matches_formula_and_serves(fake_meminfo):
    engine = _engine()
    pool = engine.runner.pool
    assert pool.activation_bytes > 0  # the compiled largest bucket's temp buffers
    assert pool.in_use_bytes == param_bytes(engine.runner.state)
    n = _expected_pages(engine)
    assert 100 < n < 2000
    assert pool.num_pages == engine.settings.num_pages == engine.runner.kv_cache.num_pages == n
    assert engine.stats()["pages_total"] == n - 1
    assert engine.runner.kv_cache.nbytes() == n * pool.page_bytes  # what was allocated
    assert pool.tokens == (n - 1) * engine.settings.page_size
    engine.warmup(progress=False)
    out = engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4))
    assert len(out[0].token_ids) == 4


def test_planner_agrees_with_engine(fake_meminfo):
    engine = _engine()
    pool = engine.runner.pool
    hw = Hardware(name="fake", description="", bf16_flops=1e12, fp32_flops=1e12, hbm_bytes=pool.capacity_bytes,
                  hbm_bytes_per_s=1e11, link_bytes_per_s=0, source="test")
    planned = kv_pool_pages(engine.config, hw, pool.activation_bytes)
    assert planned["kv_page_bytes_per_device"] == pool.page_bytes
    assert abs(planned["kv_pool_pages"] - pool.num_pages) <= 1
    assert planned["kv_pool_tokens"] == (planned["kv_pool_pages"] - 1) * engine.settings.page_size


@pytest.mark.slow
def test_quantized_cache_fits_more_pages(fake_meminfo):
    bf16 = {"model.dtype": "bfloat16"}
    plain, quant = _engine(**bf16), _engine(**bf16, **{"engine.kv_cache_dtype": "int8"})
    p, q = plain.runner.pool, quant.runner.pool
    # bf16: 2 B per value; int8: 1 B + a 4 B scale per head_dim=32 values -> 64 / 36 = 1.78x
    assert p.page_bytes * 36 == q.page_bytes * 64
    assert q.num_pages == _expected_pages(quant) and p.num_pages == _expected_pages(plain)
    assert 1.7 < q.num_pages / p.num_pages < 1.85
    assert quant.runner.kv_cache.nbytes() == q.num_pages * q.page_bytes


def test_cpu_cap_bounds_the_pool(fake_meminfo):
    engine = _engine(**{"engine.cpu_kv_cache_gb": 0.002})  # 2 MiB: below what the free RAM allows
    pool = engine.runner.pool
    assert pool.num_pages == int(0.002 * (1 << 30) // pool.page_bytes) < _expected_pages(engine)
    assert engine.runner.kv_cache.nbytes() == pool.num_pages * pool.page_bytes
    assert "capped by engine.cpu_kv_cache_gb=0.002" in pool.describe()
    cpu = Hardware(name="cpu", description="", bf16_flops=1e12, fp32_flops=1e12, hbm_bytes=pool.capacity_bytes,
                   hbm_bytes_per_s=1e11, link_bytes_per_s=0, source="test", shared_by_mesh=True)
    assert kv_pool_pages(engine.config, cpu, pool.activation_bytes)["kv_pool_pages"] == pool.num_pages  # jaxfill plan


def test_the_activation_peak_is_remembered_beside_the_compile_cache(fake_meminfo, tmp_path, monkeypatch):
    """engine/activation_cache.py: a warm start reads the peak instead of deserializing the
    largest bucket's executable; another program gets its own entry."""
    import json

    from jaxfill.engine import activation_cache

    path = tmp_path / activation_cache.FILE
    monkeypatch.setattr(activation_cache, "_path", lambda: str(path))
    measured = _engine().runner.pool.activation_bytes
    (key, value), = json.loads(path.read_text()).items()
    assert value == measured > 0
    path.write_text(json.dumps({key: measured + 7 * 4096}))  # what the next start must read, not measure
    assert _engine().runner.pool.activation_bytes == measured + 7 * 4096
    _engine(**{"engine.token_buckets": [16, 32], "engine.max_num_batched_tokens": 32})
    assert len(json.loads(path.read_text())) == 2


def test_the_activation_key_covers_what_decides_the_program(monkeypatch):
    """The key is computed without tracing, so it must change with everything the program
    depends on: the config, the arguments' shapes and dtypes, the source, the XLA flags."""
    import jax.numpy as jnp

    from jaxfill.engine import activation_cache

    config = load_config("tiny_random")
    other = load_config("tiny_random", {"engine.max_num_batched_tokens": 64})
    x = jnp.ones((4, 8), jnp.float32)
    key = activation_cache.program_key(config, {"w": x}, [x])
    assert key == activation_cache.program_key(config, {"w": jnp.full((4, 8), 2.0)}, [x])  # values do not count
    assert key != activation_cache.program_key(other, {"w": x}, [x])
    assert key != activation_cache.program_key(config, {"w": x.astype(jnp.bfloat16)}, [x])
    assert key != activation_cache.program_key(config, {"w": x[:2]}, [x])
    assert key != activation_cache.program_key(config, {"v": x}, [x])
    with monkeypatch.context() as m:
        m.setattr(activation_cache, "source_digest", lambda: "edited")
        assert key != activation_cache.program_key(config, {"w": x}, [x])
    assert key == activation_cache.program_key(config, {"w": x}, [x])
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=true")
    assert key != activation_cache.program_key(config, {"w": x}, [x])


def test_no_room_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(memory, "host_memory_available", lambda: 1 << 20)
    with pytest.raises(ValueError, match="no room for a KV pool"):
        _engine()


@pytest.mark.parametrize("key,value", [("engine.num_pages", 1), ("engine.num_pages", -3),
                                       ("engine.memory_utilization", 0), ("engine.memory_utilization", 1.5),
                                       ("engine.cpu_kv_cache_gb", -1)])
def test_bad_settings_refused(key, value):
    with pytest.raises(ConfigError, match=key.split(".")[1]):
        load_config("tiny_random", {key: value})


def test_pool_pages_formula():
    assert memory.pool_pages(1000, 100, 50, 100, 0.5) == 3  # (500 - 150) // 100
    assert memory.pool_pages(100, 100, 0, 10, 0.9) == 0
    with pytest.raises(ValueError):
        memory.pool_pages(100, 0, 0, 0, 0.9)
    assert dataclasses.is_dataclass(memory.PoolSize)


def test_jaxfill_plan_reports_the_pool(capsys):
    """`jaxfill plan` prints what engine.num_pages=0 gives: the planner's kv_pool_pages."""
    import json

    from jaxfill.engine.planner.hardware import load_hardware
    from jaxfill.serving.cli import main

    assert main(["plan", "--config", "llama3_8b", "--hardware", "h100_sxm", "--prompt-len", "2048",
                 "--activation-bytes", str(3 << 30), "--set", "engine.kv_cache_dtype=int8", "--json"]) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    cfg = load_config("llama3_8b", {"engine.kv_cache_dtype": "int8"})
    hw = load_hardware("h100_sxm")
    # by hand: (80 GB x 0.9 - 8.03e9 bf16 weights - 3 GiB) / (16 x 32 layers x 8 heads x 2 x (128 + 4) B)
    by_hand = int((hw.hbm_bytes * 0.9 - 2 * param_count(cfg.model) - (3 << 30)) // (16 * 32 * 8 * 2 * 132))
    assert row["kv_pool_pages"] == kv_pool_pages(cfg, hw, 3 << 30)["kv_pool_pages"] == by_hand
    assert row["kv_pool_tokens"] == (by_hand - 1) * 16
