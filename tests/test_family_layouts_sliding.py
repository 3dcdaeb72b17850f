"""The windowed families, Gemma 2, Gemma 3 and Phi-3 (prompts longer than the window):
unchunked == chunked == prefix-cached == tensor=2 == scan_layers == stage=2 through the
Engine, int8 close (tests/family_layouts.py). Over a minute: seven engines per family;
Gemma 3's scanned and staged layouts switch between its two windows by layer number."""

import pytest

from family_layouts import check_every_layout


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3"])
def test_every_layout_gives_the_same_tokens(hf_dirs, arch):
    check_every_layout(hf_dirs[arch], arch)
