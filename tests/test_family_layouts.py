"""Qwen3, OLMo 2, SmolLM3, Granite, ERNIE 4.5 (interleaved rope pairs) and Hunyuan (q/k
norms after rope): unchunked == chunked == prefix-cached == tensor=2
== scan_layers == stage=2 through the Engine, int8 close (tests/family_layouts.py). About
35-50 s a family (2 cores, cold compile cache): seven engines, each compiling one bucket.
Several minutes for the file, because it is six families."""

import pytest

from family_layouts import check_every_layout


@pytest.mark.parametrize("arch", ["qwen3", "olmo2", "smollm3", "granite", "ernie4_5", "hunyuan_v1_dense"])
def test_every_layout_gives_the_same_tokens(hf_dirs, arch):
    check_every_layout(hf_dirs[arch], arch)
