"""One engine run for tests/test_context_engine.py, in its own process (the fake CPU
device count is fixed when jax starts): greedy tokens, first-token logprobs, prefix hits,
the pool's per-device bytes, and the pages left after an abort mid-prefill, as one JSON line.

    python tests/context_worker.py '{"overrides": {...}, "long": true, "mid": 1536}'
"""

from __future__ import annotations

import json
import sys

import numpy as np

LONG, MID = 4000, 1536  # prompt lengths: the long one needs 250 pages of 16


def prompts(long: bool, mid_len: int = MID) -> list[list[int]]:
    rng = np.random.default_rng(0)
    mid = [int(x) for x in rng.integers(0, 256, mid_len)]
    hit = mid_len * 2 // 3 // 16 * 16  # 1024 of 1536: a prefix hit of whole pages on `mid`
    shared = mid[:hit] + [int(x) for x in rng.integers(0, 256, 700)]
    out = [mid, shared]
    return out + [[int(x) for x in rng.integers(0, 256, LONG)]] if long else out


def main(spec: dict) -> dict:
    from jaxfill.engine.config import load_config
    from jaxfill.engine.engine import Engine
    from jaxfill.engine.request import SamplingParams

    engine = Engine(load_config("tiny_random", spec["overrides"]), progress=False, warmup=False)
    params = SamplingParams(max_tokens=4, logprobs=1)
    out = {"tokens": [], "logprob": [], "cached": []}
    for p in prompts(spec.get("long", False), spec.get("mid", MID)):  # one at a time: the second hits the first's pages
        c = engine.generate([p], params)[0]
        out["tokens"].append(c.token_ids)
        out["logprob"].append(c.logprobs[0]["logprob"])
        out["cached"].append(c.cached_tokens)
    st = engine.stats()
    cache = engine.runner.kv_cache
    out.update(kv_bytes=st["kv_cache_bytes"], kv_bytes_device=st["kv_cache_bytes_per_device"],
               device_shares=sorted({cache.nbytes_on(d) for d in engine.runner.mesh.devices.flat})
               if engine.runner.mesh is not None else [cache.nbytes_on()],
               pages_total=st["pages_total"], free_after=st["pages_free"])
    if not spec.get("abort", True):
        return out
    # An abort after the first chunk of a long prefill gives every page back.
    rid = engine.add_request(prompts(False)[0] * 2, SamplingParams(max_tokens=4))
    engine.step()
    held = engine.stats()["pages_free"]
    engine.abort(rid)
    engine.step()
    out.update(free_mid_prefill=held, free_after_abort=engine.stats()["pages_free"])
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(json.loads(sys.argv[1]))))
