"""Linear-attention hybrids through the Engine in every layout they support, one
subprocess per model on 2 fake CPU devices (tests/family_layouts.py). Qwen3.5 and
Qwen3-Next and Qwen3.5-MoE (Gated DeltaNet): unchunked == 16-token chunks == prefix-cached through state
snapshots every 32 tokens == mesh.tensor = 2 (each rank one key-head group's params and
state) with snapshots too. Nemotron-H (Mamba2, 4 groups of 2 heads: each rank two groups'
params and state): unchunked == tensor 2 with snapshots, whole and in 16-token chunks
(its one-device chunks and snapshots: tests/test_nemotron_h_parity.py). The same greedy
tokens and first logprobs, every page back, and at tensor 2 every state array allocated
split: half its heads (channels) on each device."""

import pytest

from family_layouts import check_layouts, run_layouts
from hf_models import make_hf_checkpoint

SNAPSHOTS = {"engine.state_snapshot_tokens": 32}
CHUNKED = {"engine.max_num_batched_tokens": 16, "engine.token_buckets": [16]}
LAYOUTS = {
    "whole": {"engine.enable_prefix_caching": False},
    "chunked": {"engine.enable_prefix_caching": False, **CHUNKED},
    "prefix": SNAPSHOTS,
    "tensor2": {"mesh.tensor": 2, **SNAPSHOTS},
    "tensor2_chunked": {"mesh.tensor": 2, **CHUNKED, **SNAPSHOTS},
}
MODELS = {"qwen3_5": ({}, LAYOUTS), "qwen3_next": ({}, LAYOUTS), "qwen3_5_moe": ({}, LAYOUTS),
          "nemotron_h": ({"n_groups": 4}, {n: LAYOUTS[n] for n in ("whole", "tensor2", "tensor2_chunked")})}


@pytest.mark.slow  # 49 s in a full run (2026-12-07, 2 loaded cores)
@pytest.mark.parametrize("arch", list(MODELS))
def test_hybrid_layouts_agree(tmp_path, arch):
    extra, layouts = MODELS[arch]
    directory = make_hf_checkpoint(str(tmp_path / arch), arch, **extra)
    r = run_layouts(directory, layouts, devices=2)
    check_layouts(r, arch, exact=tuple(n for n in layouts if n != "whole"))
    (_, heads, *rest), (_, channels, k) = r["whole"]["state_shard"]  # [slots, ...]: snapshots add slots
    for name in layouts:
        split = 2 if name.startswith("tensor2") else 1
        got = [shape[1:] for shape in r[name]["state_shard"]]
        assert got == [[heads // split, *rest], [channels // split, k]], (name, got)
    if "prefix" not in layouts:  # the tensor-2 runs resumed from snapshots of the shared 72 tokens
        assert r["tensor2"]["cached"][1] >= 64, r["tensor2"]["cached"]
