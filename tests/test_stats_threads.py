"""stats() and held_page_share() read from other threads while the stepping thread donates
the KV cache every step.

A PD soak through smg found the prefill worker's gRPC thread reading the cache's shards
(`kv_cache_bytes_per_device`) just after a step had donated them: "Array has been deleted".
The byte counts are fixed when the cache is built, so stats() must never touch a device
array; these threads hammer both readers during a long run of steps and every call must
return (and agree with the counts taken before the run).
"""

import threading

import numpy as np
import pytest

from jaxfill.engine.config import load_config
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams
from fast_engine import REFERENCE_ATTENTION

OVERRIDES = {**REFERENCE_ATTENTION,  # tests/fast_engine.py
             "engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64], "engine.num_pages": 64,
             "engine.max_model_len": 256, "engine.max_num_seqs": 8, "engine.async_scheduling": True}


@pytest.mark.slow
def test_stats_and_held_share_from_threads_during_donating_steps():
    eng = Engine(load_config("tiny_random", OVERRIDES), progress=False)
    eng.enable_kv_transfer()  # held_page_share reads the hand-off's state too
    before = eng.stats()
    stop = threading.Event()
    errors: list[BaseException] = []
    calls = [0]

    def hammer():
        while not stop.is_set():
            try:
                st = eng.stats()
                share = eng.held_page_share()
                assert st["kv_cache_bytes_per_device"] == before["kv_cache_bytes_per_device"]
                assert st["kv_cache_bytes"] == before["kv_cache_bytes"]
                assert 0.0 <= share <= 1.0
                calls[0] += 1
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
                return

    threads = [threading.Thread(target=hammer) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(1, 60, 24)]
        for rid in range(len(prompts)):  # a few held like a prefill worker's requests
            if rid % 3 == 0:
                eng.add_request(prompts[rid], SamplingParams(max_tokens=12, ignore_eos=True), request_id=f"r{rid}")
                eng.hold_pages(f"r{rid}")
        done = eng.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, repr(errors[0])
    assert calls[0] > 20 and len(done) == len(prompts)
    assert eng.num_steps > 20 and eng.stats()["num_cache_resets"] == 0
    # the counts taken at build are the cache's (read here, on the stepping thread, idle)
    assert before["kv_cache_bytes_per_device"] == eng.runner.kv_cache.nbytes_on() > 0
    assert before["kv_cache_bytes"] == eng.runner.kv_cache.nbytes()
