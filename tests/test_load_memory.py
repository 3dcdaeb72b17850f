"""Loading a checkpoint onto 8 devices needs about one tensor of host memory beyond the
params, not the whole checkpoint (benchmarks/load_memory.py measures; this bounds it)."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from load_memory import hf_config, measure, write_checkpoint  # noqa: E402


def test_sharded_load_transient_memory_is_about_one_tensor(tmp_path):
    # 46 MiB of f32 weights, largest tensor (embedding, LM head) 8 MiB.
    ckpt = write_checkpoint(str(tmp_path), hf_config(hidden=512, layers=2, vocab=4096))
    (r,) = measure(str(tmp_path), tensor=8)
    assert r["devices"] == 8 and r["jaxfill"] == ROOT, r
    # The measurement sees the params (on CPU the 8 devices live in this process).
    assert r["params_rss"] >= 0.9 * ckpt["file_bytes"], (r, ckpt)
    # ...and nothing of the file stays behind once loaded (measured: params + 11 MiB).
    assert r["params_rss"] <= 1.5 * r["local_shard_bytes"], (r, ckpt)
    # Beyond them, the load needed at most about one tensor (its 8 slices), never the
    # file: a loader that keeps the checkpoint mapped holds all of it resident.
    assert r["transient"] <= 1.5 * ckpt["largest_tensor_bytes"], (r, ckpt)
    assert r["transient"] <= 0.25 * ckpt["file_bytes"], (r, ckpt)
