"""One process of tests/test_pipeline_multihost.py: 2 CPU devices per process,
jax.distributed over 127.0.0.1, the Engine on mesh.stage=2 (x mesh.tensor), so each
process should hold one pipeline stage, its two devices split by AXIS (tensor or data).
Process 0 generates, process 1 follows.

    python tests/pipeline_multihost_worker.py PROCESS_ID PORT AXIS OUT_JSON

Writes {"tokens": [[...], ...], "cached": [...], "steps_run": n, "mesh_stage_of_local": [...],
"params": {path: {"spec": ..., "shape": [...], "indices": [[[start, stop], ...], ...]}},
"kv": {...}} (process 1: no tokens; "error" on failure).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Small buckets; 16-token chunks so the 40-token prompt is prefilled in 3 steps and the
# second round's prompts find its first two 8-token pages in the prefix cache.
ENGINE = {"engine.attention_impl": "reference",  # tests/fast_engine.py
          "engine.page_size": 8, "engine.max_num_batched_tokens": 16, "engine.token_buckets": [16],
          "engine.seq_buckets": [4], "engine.max_num_seqs": 4, "engine.num_pages": 64,
          "engine.max_model_len": 256}
LONG = [(37 * i + 11) % 250 for i in range(40)]
ROUNDS = [  # generate() per round: round 2 repeats round 1's 16-token prefix
    [LONG, [5, 6, 7]],
    [LONG[:16] + [9, 8, 7, 6, 5], LONG[:16] + [1, 2]],
]
MAX_TOKENS = 6


def reference_tokens(overrides: dict | None = None) -> list[list[int]]:
    """One process, one device, no pipeline: the tokens the two-process run must give."""
    from jaxfill.engine.engine import Engine

    engine = Engine.from_config("tiny_random", overrides={**ENGINE, **(overrides or {})}, progress=False)
    return [t for r in run_rounds(engine) for t in r[0]]


def run_rounds(engine) -> list[tuple[list[list[int]], list[int]]]:
    """Greedy, every round after the previous one finished: [(tokens, cached_tokens)]."""
    from jaxfill.engine.request import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    out = []
    for prompts in ROUNDS:
        done = engine.generate(prompts, params)
        out.append(([list(c.token_ids) for c in done], [c.cached_tokens for c in done]))
    return out


def shard_layout(tree) -> dict:
    """Per leaf: its PartitionSpec (mesh axes per dim), global shape and the index (per dim [start, stop]) of
    every shard on this process's devices."""
    import jax

    layout = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not isinstance(leaf, jax.Array):
            continue
        indices = [[[s.start or 0, dim if s.stop is None else s.stop] for s, dim in zip(shard.index, leaf.shape)]
                   for shard in leaf.addressable_shards]
        spec = [[] if a is None else list(a) if isinstance(a, tuple) else [a] for a in leaf.sharding.spec]
        layout[jax.tree_util.keystr(path)] = {"spec": spec, "shape": list(leaf.shape), "indices": indices}
    return layout


def main():
    process_id, port, axis, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    result: dict = {}
    try:
        from jaxfill.engine.engine import Engine

        overrides = {**ENGINE, "mesh.stage": 2, f"mesh.{axis}": 2, "mesh.coordinator": f"127.0.0.1:{port}",
                     "mesh.num_processes": 2, "mesh.process_id": process_id}
        with Engine.from_config("tiny_random", overrides=overrides, progress=False) as engine:
            import jax

            runner = engine.runner
            grid = np.moveaxis(runner.mesh.devices, runner.mesh.axis_names.index("stage"), 0)
            stage_of = {d: s for s in range(grid.shape[0]) for d in grid[s].flat}
            result.update(process_index=jax.process_index(), local_devices=len(jax.local_devices()),
                          mesh_stage_of_local=sorted(stage_of[d] for d in jax.local_devices()),
                          params=shard_layout(runner.state), kv=shard_layout(runner.kv_cache))
            if engine.is_leader:
                rounds = run_rounds(engine)
                result.update(tokens=[t for r in rounds for t in r[0]], cached=[c for r in rounds for c in r[1]],
                              steps_run=engine.num_steps + len(engine.shapes))  # + one warm-up step per bucket
            else:
                result["steps_run"] = engine.follow()
    except Exception:  # noqa: BLE001 - reported, the test decides
        result["error"] = traceback.format_exc()[-4000:]
    with open(out_path, "w") as f:
        json.dump(result, f)
    import jax

    if jax.distributed.is_initialized():
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
