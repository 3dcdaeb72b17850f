"""LFM2 and LFM2-MoE through the Engine in every layout the capability table gives them
(tests/family_layouts.py, one subprocess per model on fake CPU devices): unchunked ==
16-token chunks == prefix-cached through state snapshots every 32 tokens == mesh.tensor = 2
(each rank half the short convolution's channels: its B, C, x columns, conv taps, output
rows and conv history) with snapshots, in 16-token chunks; LFM2-MoE (4 devices) mesh.expert
= 4 and expert 2 x tensor 2 with snapshots (experts split over expert ranks, the conv
history replicated over them, split over tensor).
The same greedy tokens and first logprobs, every page back, and at tensor 2 every conv
history allocated split: half its channels on each device."""

import pytest

from family_layouts import check_layouts, run_layouts
from hf_models import make_hf_checkpoint
from test_hybrid_layouts import LAYOUTS, SNAPSHOTS

MODELS = {  # arch: (devices, layouts)
    "lfm2": (2, {n: LAYOUTS[n] for n in ("whole", "chunked", "prefix", "tensor2_chunked")}),
    "lfm2_moe": (4, {**{n: LAYOUTS[n] for n in ("whole", "chunked", "prefix")},
                     "expert4": {"mesh.expert": 4, **SNAPSHOTS},
                     "expert2_tensor2": {"mesh.expert": 2, "mesh.tensor": 2, **SNAPSHOTS}}),
}


@pytest.mark.slow  # 65 s in a full run (2026-12-07, 2 loaded cores)
@pytest.mark.parametrize("arch", list(MODELS))
def test_lfm2_layouts_agree(tmp_path, arch):
    devices, layouts = MODELS[arch]
    directory = make_hf_checkpoint(str(tmp_path / arch), arch)
    r = run_layouts(directory, layouts, devices=devices)
    check_layouts(r, arch, exact=tuple(n for n in layouts if n != "whole"))
    (_, none), (_, channels, k) = r["whole"]["state_shard"]  # [slots, ...]: snapshots add slots
    assert none == 0 and channels == 64, r["whole"]["state_shard"]
    for name in layouts:
        split = 2 if "tensor2" in name else 1
        assert [shape[1:] for shape in r[name]["state_shard"]] == [[0], [channels // split, k]], name
