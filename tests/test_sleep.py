"""Engine.sleep / wake: device memory given back, the compiled programs kept.

Level 1 deletes the KV pool, level 2 the weights too (kept on the host, or reloaded from
the checkpoint with discard=True). The bytes on the device drop by exactly those arrays'
(the engine's own count and jax.live_arrays() agree), greedy tokens after wake equal the
ones before, nothing compiles, and a request while asleep gets EngineAsleep.
"""

import jax
import pytest

from fast_engine import REFERENCE_ATTENTION
from jaxfill import Engine, SamplingParams
from jaxfill.engine.config import load_config
from jaxfill.engine.sleep import EngineAsleep

OVER = {**REFERENCE_ATTENTION, "engine.max_model_len": 256, "engine.num_pages": 64, "engine.max_num_seqs": 4,
        "engine.max_num_batched_tokens": 32, "engine.token_buckets": [32]}
PROMPTS = [list(range(5, 38)), [7, 8, 9, 10]]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    from hf_models import make_hf_checkpoint

    path = make_hf_checkpoint(str(tmp_path_factory.mktemp("sleep") / "llama"), "llama", seed=3)
    return Engine(load_config("tiny_random", OVER, path), progress=False)


@pytest.fixture(scope="module")
def before(eng):
    return [c.token_ids for c in eng.generate(PROMPTS, GREEDY)]


def live_bytes() -> int:
    """Bytes of every live device buffer, each once (several Array objects may alias one)."""
    bufs = {(s.device, s.data.unsafe_buffer_pointer()): s.data.nbytes
            for a in jax.live_arrays() if not a.is_deleted() for s in a.addressable_shards}
    return sum(bufs.values())


@pytest.mark.parametrize("level, discard", [(1, False), (2, False), (2, True)])
def test_sleep_frees_and_wake_restores(eng, before, level, discard):
    st = eng.stats()
    programs, kv, weights = st["compiled_programs"], st["kv_cache_bytes"], st["weight_bytes"]
    want = kv + (weights if level == 2 else 0)
    dev, live = st["device_bytes"], live_bytes()
    assert eng.sleep(level, discard=discard)["freed_bytes"] == want
    asleep = eng.stats()
    assert asleep["sleeping"] == level and asleep["device_bytes"] == dev - want
    assert live - live_bytes() == want
    eng.wake()
    assert eng.stats()["sleeping"] == 0 and eng.stats()["device_bytes"] == dev and live_bytes() == live
    got = eng.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in got] == before
    assert got[0].cached_tokens == 0  # the prefix cache went with the pool
    assert eng.stats()["compiled_programs"] == programs


def test_requests_while_asleep_get_engine_asleep(eng, before):
    eng.sleep(1)
    try:
        with pytest.raises(EngineAsleep, match="the engine sleeps .level 1.; call wake"):
            eng.add_request(PROMPTS[0], GREEDY)
        with pytest.raises(EngineAsleep):
            eng.generate(PROMPTS, GREEDY)
        with pytest.raises(EngineAsleep, match="update_weights"):
            eng.update_weights(eng.runner.state)
        with pytest.raises(EngineAsleep, match="sleep"):
            eng.sleep(2)
        assert not eng.has_unfinished()
    finally:
        eng.wake()
    assert [c.token_ids for c in eng.generate(PROMPTS, GREEDY)] == before


def test_sleep_refused_while_requests_run(eng, before):
    rid = eng.add_request(PROMPTS[0], GREEDY)
    eng.step()
    dev = eng.stats()["device_bytes"]
    with pytest.raises(RuntimeError, match="1 requests unfinished"):
        eng.sleep(1)
    assert eng.stats()["sleeping"] == 0 and eng.stats()["device_bytes"] == dev
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [o.completion.token_ids for o in outs if o.finished and o.request_id == rid] == [before[0]]


def test_bad_levels(eng):
    with pytest.raises(ValueError, match="level: 1 .KV pool. or 2"):
        eng.sleep(3)
    with pytest.raises(ValueError, match="discard: only level 2"):
        eng.sleep(1, discard=True)
    assert eng.stats()["sleeping"] == 0


def test_discard_needs_a_checkpoint():
    e = Engine(load_config("tiny_random", {**OVER, "engine.num_pages": 16}), progress=False, warmup=False)
    with pytest.raises(ValueError, match="discard: .* has none .random init."):
        e.sleep(2, discard=True)
