"""The disk tier below the host tier: a restarted engine serves its old prefixes from
files, refuses corrupt ones and ignores another layout's (tiny_random, NaN-filled pages)."""

import logging
import os

import numpy as np
import pytest

import kv_tier_workload as wl
from jaxfill import Engine
from jaxfill.engine.kv_tier.disk import decode, encode
from jaxfill.engine.kv_tier.host import KVBlock

BLOCK_BYTES = 4 * 8 * 4 * 32 * 4  # [L, P, 2*Hkv, D] f32


def engine(directory, **overrides) -> Engine:
    tiers = {"engine.host_kv_cache_gb": 3.5 * BLOCK_BYTES / 2**30,  # three blocks: most go on to disk
             "engine.disk_kv_cache_dir": str(directory), "engine.disk_kv_cache_gb": 0.01}
    return Engine.from_config("tiny_random", overrides={**wl.BASE, **tiers, **overrides}, progress=False)


@pytest.fixture(scope="module")
def plain():
    return wl.run(Engine.from_config("tiny_random", overrides=wl.BASE, progress=False))


@pytest.fixture(scope="module")
def written(tmp_path_factory, plain):
    """A first engine ran the workload and closed: its blocks are files."""
    directory = tmp_path_factory.mktemp("kv")
    e = engine(directory)
    first = wl.run(e)
    e.close()  # waits for the writes
    assert first["tokens"] == plain["tokens"]
    assert first["stats"]["disk_kv_hits"] > 0  # the host tier alone is too small for the workload
    return directory, first


def files(directory) -> list[str]:
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".kvb"))


@pytest.mark.slow
def test_a_restarted_engine_serves_old_prefixes_from_disk(written, plain, tmp_path):
    directory, first = written
    copy = tmp_path / "kv"
    copy.mkdir()
    for f in files(directory):
        (copy / os.path.basename(f)).write_bytes(open(f, "rb").read())
    e = engine(copy)
    assert e.stats()["disk_kv_pages_used"] == len(files(directory)) > 0
    again = wl.run(e)
    assert again["tokens"] == plain["tokens"]
    first_round = wl.NUM_DOCS
    assert sum(again["cached"][:first_round]) > 0  # nothing on the device or in host memory yet
    assert again["stats"]["disk_kv_hit_tokens"] > first["stats"]["disk_kv_hit_tokens"]


def test_corrupt_and_truncated_files_are_refused(written, plain, tmp_path):
    directory, _ = written
    copy = tmp_path / "kv"
    copy.mkdir()
    for i, f in enumerate(files(directory)):
        data = bytearray(open(f, "rb").read())
        if i % 2:
            data[-5] ^= 0xFF  # a flipped bit in the payload
        else:
            data = data[:len(data) - 40]  # cut short
        (copy / os.path.basename(f)).write_bytes(bytes(data))
    e = engine(copy)
    again = wl.run(e)
    assert again["tokens"] == plain["tokens"]
    st = again["stats"]
    assert st["disk_kv_corrupt"] > 0
    assert sum(again["cached"][:wl.NUM_DOCS]) == 0  # the first round found nothing it could use


@pytest.mark.slow
def test_files_of_another_layout_are_ignored(written, caplog):
    directory, _ = written
    before = files(directory)
    with caplog.at_level(logging.INFO, logger="jaxfill.kv_tier"):
        e = engine(directory, **{"engine.kv_cache_dtype": "int8"})
    assert e.stats()["disk_kv_pages_used"] == 0
    assert any(f"ignored {len(before)} files" in r.getMessage() for r in caplog.records)
    # what serve logs at start: the host budget (3.5 f32 pages) in int8 pages of 4*8*4*(32+4) bytes
    assert any("hold 12 pages (96 tokens, 4608 bytes a page)" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]
    assert files(directory) == before  # left alone: another engine may own them


def test_block_files_round_trip_and_refuse_damage():
    rng = np.random.default_rng(0)
    block = KVBlock(rng.integers(-128, 127, (2, 4, 2, 8), dtype=np.int8),
                    rng.random((2, 4, 2)).astype(np.float32), b"p" * 16, (1, 2, 3, 4))
    data = encode(block, "fp")
    back = decode(data, "fp")
    assert np.array_equal(back.values, block.values) and np.array_equal(back.scales, block.scales)
    assert back.parent == block.parent and back.tokens == block.tokens
    with pytest.raises(ValueError, match="another model"):
        decode(data, "other")
    with pytest.raises(ValueError, match="checksum"):
        decode(data[:-1] + bytes([data[-1] ^ 1]), "fp")
    with pytest.raises(ValueError):
        decode(data[:30], "fp")
