"""Qwen3, OLMo 2, SmolLM3 and Granite: unchunked == chunked == prefix-cached == tensor=2
== scan_layers == stage=2 through the Engine, int8 close (tests/family_layouts.py). About
35-50 s a family (2 cores, cold compile cache): seven engines, each compiling one bucket.
Over a minute for the file, because it is four families; this round's dense families are
in tests/test_family_layouts_round.py so the suite's two workers share them."""

import pytest

from family_layouts import LAYOUTS, check_every_layout

# xla (the CPU default) under every mesh axis, on Qwen3; the other layouts, and the other
# families, run on the reference impl (tests/family_layouts.py says why)
XLA_LAYOUTS = {name: LAYOUTS[name] for name in ("whole", "tensor2", "sequence2", "stage2")}


@pytest.mark.parametrize("arch", ["qwen3", "olmo2", "smollm3", "granite"])
def test_every_layout_gives_the_same_tokens(hf_dirs, arch):
    check_every_layout(hf_dirs[arch], arch)


def test_xla_under_every_mesh_axis_gives_the_same_tokens(hf_dirs):
    check_every_layout(hf_dirs["qwen3"], "qwen3", XLA_LAYOUTS, ("tensor2", "sequence2", "stage2"), impl="auto")
