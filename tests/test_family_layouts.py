"""Qwen3, OLMo 2, SmolLM3 and Granite: unchunked == chunked == prefix-cached == tensor=2
== scan_layers == stage=2 through the Engine, int8 close (tests/family_layouts.py). About
35-50 s a family (2 cores, cold compile cache): seven engines, each compiling one bucket.
Over a minute for the file, because it is four families; this round's dense families are
in tests/test_family_layouts_round.py so the suite's two workers share them."""

import pytest

from family_layouts import check_every_layout


@pytest.mark.parametrize("arch", ["qwen3", "olmo2", "smollm3", "granite"])
def test_every_layout_gives_the_same_tokens(hf_dirs, arch):
    # Qwen3 through xla (every other family: the reference impl, tests/family_layouts.py)
    check_every_layout(hf_dirs[arch], arch, impl="auto" if arch == "qwen3" else "reference")
