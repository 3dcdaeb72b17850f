"""This round's dense families through the Engine in every layout (tests/family_layouts.py):
Apertus (xIELU's scalar params stacked and sharded like any other), ERNIE 4.5 (interleaved
rope pairs) and Hunyuan (q/k norms after rope): unchunked == chunked == prefix-cached ==
tensor=2 == sequence=2 == scan_layers == stage=2, int8 close. About 35-50 s a family (2
cores, cold compile cache); apart from tests/test_family_layouts.py so the suite's two
workers share them."""

import pytest

from family_layouts import check_every_layout


@pytest.mark.parametrize("arch", ["apertus", "ernie4_5", "hunyuan_v1_dense"])
def test_every_layout_gives_the_same_tokens(hf_dirs, arch):
    check_every_layout(hf_dirs[arch], arch)
