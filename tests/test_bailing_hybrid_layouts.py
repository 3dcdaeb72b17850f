"""Ling 2.5 through the Engine in every layout it supports, one subprocess on 2 fake CPU
devices (tests/family_layouts.py): unchunked == 16-token chunks == prefix-cached through
KDA state snapshots every 32 tokens == mesh.tensor = 2 (each rank two KDA heads' params,
full-rank gates and state, half the latent attention's heads and their gates, half of
each expert) with snapshots, whole and chunked. The same greedy tokens and first
logprobs, every page back, and at tensor 2 every state array allocated split."""

import pytest
from family_layouts import check_layouts, run_layouts
from hf_models import make_hf_checkpoint
from test_hybrid_layouts import LAYOUTS


@pytest.mark.slow  # 56 s in a full run (2026-12-07, 2 loaded cores)
def test_bailing_hybrid_layouts_agree(tmp_path):
    directory = make_hf_checkpoint(str(tmp_path / "bailing_hybrid"), "bailing_hybrid")
    r = run_layouts(directory, LAYOUTS, devices=2)
    check_layouts(r, "bailing_hybrid", exact=tuple(n for n in LAYOUTS if n != "whole"))
    (_, heads, *rest), (_, channels, k) = r["whole"]["state_shard"]  # [slots, ...]: snapshots add slots
    for name in LAYOUTS:
        split = 2 if name.startswith("tensor2") else 1
        got = [shape[1:] for shape in r[name]["state_shard"]]
        assert got == [[heads // split, *rest], [channels // split, k]], (name, got)
