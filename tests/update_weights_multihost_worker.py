"""One process of tests/test_update_weights_multihost.py: two processes x one CPU device,
jax.distributed on 127.0.0.1, mesh.tensor = 2 across them. Process 0 generates, updates
the weights from another checkpoint, sleeps and wakes; process 1 follows.

    python tests/update_weights_multihost_worker.py PROCESS_ID PORT OUT_JSON CKPT_A CKPT_B
"""

from __future__ import annotations

import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

OVER = {"engine.attention_impl": "reference", "engine.max_model_len": 256, "engine.num_pages": 64,
        "engine.max_num_seqs": 4, "engine.max_num_batched_tokens": 32, "engine.token_buckets": [32]}
PROMPTS = [list(range(5, 38)), [7, 8, 9, 10]]


def main() -> None:
    process_id, port, out_path, path_a, path_b = sys.argv[1:6]
    from jaxfill.engine.config import load_config
    from jaxfill.engine.engine import Engine
    from jaxfill.engine.request import SamplingParams
    from jaxfill.engine.weights_update import WeightUpdateError

    over = {**OVER, "mesh.tensor": 2, "mesh.coordinator": f"127.0.0.1:{port}", "mesh.num_processes": 2,
            "mesh.process_id": int(process_id)}
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    out: dict = {}
    try:
        with Engine(load_config("tiny_random", over, path_a), progress=False) as e:
            if not e.is_leader:
                out["steps"] = e.follow()
            else:
                def tokens():
                    return [c.token_ids for c in e.generate(PROMPTS, greedy)]

                out["a"] = tokens()
                programs = e.stats()["compiled_programs"]  # after a first generate (its steps' own programs)
                e.update_weights(path_b)
                out["b"] = tokens()
                try:
                    e.update_weights(path_b + "-missing")
                except WeightUpdateError as err:
                    out["refused"] = str(err)
                out["b_after_refusal"] = tokens()
                dev = e.stats()["device_bytes"]
                out["freed"] = e.sleep(2)["freed_bytes"]
                out["asleep_bytes"] = e.stats()["device_bytes"]
                e.wake()
                out["woken_bytes"], out["device_bytes"] = e.stats()["device_bytes"], dev
                out["b_after_wake"] = tokens()
                e.update_weights(path_a, in_flight="abort")
                out["a_again"] = tokens()
                out["compiled"] = e.stats()["compiled_programs"] - programs
                out["steps"] = e.num_steps + len(e.shapes)
    except Exception:  # noqa: BLE001 - reported, the test decides
        out["error"] = traceback.format_exc()[-4000:]
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
