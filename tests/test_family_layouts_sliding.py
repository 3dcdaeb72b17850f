"""The windowed families, Gemma 2, Gemma 3 and Phi-3 (prompts longer than the window):
unchunked == chunked == prefix-cached == tensor=2 == sequence=2 == scan_layers == stage=2
through the Engine, int8 close (tests/family_layouts.py). About 40-65 s a family on two
cores: eight engines each, seven compiles (prefix-cached reuses the plain one's program).
Gemma 3's scanned and staged layouts switch between its two windows (and rope bases) by
layer number."""

import pytest

from family_layouts import check_every_layout
from hf_models import make_hf_checkpoint

# Gemma 3 with 4 layers instead of tests/hf_models.py's 6 (5 sliding, then full): each
# unrolled layer costs every compile here ~0.7 s. Sliding, sliding | sliding, full: the
# two stages of mesh.stage=2 hold different patterns, so a stage that picked its windows
# by its local layer number (or a scan step that used layer 0's) would change the tokens.
GEMMA3_TYPES = ["sliding_attention"] * 3 + ["full_attention"]


@pytest.fixture(scope="module")
def model_dirs(hf_dirs, tmp_path_factory):
    gemma3 = make_hf_checkpoint(str(tmp_path_factory.mktemp("sliding") / "gemma3"), "gemma3",
                                num_hidden_layers=4, layer_types=GEMMA3_TYPES)
    return {**hf_dirs, "gemma3": gemma3}


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3"])
def test_every_layout_gives_the_same_tokens(model_dirs, arch):
    check_every_layout(model_dirs[arch], arch)
