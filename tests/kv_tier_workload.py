"""A prefix-reuse workload for the host/disk KV tier: more documents than the device pool
holds, questions over them in rounds, partial prefixes and salted requests. Run in
process (tests/test_host_kv_tier.py) or as a script with fake devices:

    python tests/kv_tier_workload.py '{"mesh.tensor": 2, ...}'   -> one JSON line
"""

import json
import sys

import numpy as np

# page_size 8 and 16 pages: the device holds about three of the six 32-token documents.
BASE = {"engine.attention_impl": "reference",  # tests/fast_engine.py
        "engine.page_size": 8, "engine.num_pages": 16, "engine.max_num_batched_tokens": 64,
        "engine.max_num_seqs": 4, "engine.kv_fill_value": float("nan")}
NUM_DOCS, DOC_TOKENS = 6, 32


def requests(seed: int = 0):
    """Rounds of (prompt ids, SamplingParams): whole documents, half documents, salts."""
    from jaxfill import SamplingParams

    rng = np.random.default_rng(seed)
    docs = [[int(t) for t in rng.integers(1, 250, DOC_TOKENS)] for _ in range(NUM_DOCS)]
    rounds = []
    for r in range(3):
        batch = []
        for i in rng.permutation(NUM_DOCS):
            question = [int(t) for t in rng.integers(1, 250, 5)]
            doc = docs[i] if (r + i) % 3 else docs[i][:DOC_TOKENS // 2 + 3]  # partial prefixes too
            salt = "tenant-b" if (r == 2 and i == 0) else None
            params = SamplingParams(max_tokens=4, temperature=0.8 if i % 2 else 0.0, seed=int(i), cache_salt=salt)
            batch.append((doc + question, params))
        rounds.append(batch)
    return rounds


def run(engine, seed: int = 0, per_call: int = 2) -> dict:
    """Per request: tokens, cached tokens, whether salted; and the engine's final stats."""
    tokens, cached, salted = [], [], []
    for batch in requests(seed):
        for k in range(0, len(batch), per_call):
            part = batch[k:k + per_call]
            out = engine.generate([p for p, _ in part], [s for _, s in part])
            tokens += [c.token_ids for c in out]
            cached += [c.cached_tokens for c in out]
            salted += [s.cache_salt is not None for _, s in part]
    stats = engine.stats()
    return {"tokens": tokens, "cached": cached, "salted": salted,
            "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}}


if __name__ == "__main__":
    from jaxfill import Engine

    engine = Engine.from_config("tiny_random", overrides={**BASE, **json.loads(sys.argv[1])}, progress=False)
    print(json.dumps(run(engine)))
