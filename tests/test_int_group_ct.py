"""compressed-tensors integer checkpoints (models/int_group.py), packed by the
`compressed-tensors` library itself (tests/int_checkpoints.py): pack-quantized W4A16 in
groups of 32 (symmetric, Kimi K2-Thinking's scheme) and of 128 with packed zero points,
W8A16 in groups of 128, and int-quantized W8A8 (per channel, run weight-only); and W4A16
on a Qwen2-MoE's experts and shared expert (each expert's codes stacked, dequantized per rank in the
expert-parallel matmul). Each kept packed and HF-exact on its dequantized twin, which the
library's decompressor writes."""

import pytest

pytest.importorskip("torch", reason="the Hugging Face reference and the writer need torch (the test extra)")
pytest.importorskip("compressed_tensors", reason="the writer packs with compressed-tensors (the test extra)")
from test_int_group import check_int_checkpoint, int_dirs  # noqa: F401 (the fixture)


@pytest.mark.parametrize("name", ["ct_w4a16", "ct_w4a16_asym", "ct_w8a16", "ct_w8a8"])
def test_int_checkpoint_matches_hf_on_its_dequantized_weights(int_dirs, name):  # noqa: F811
    check_int_checkpoint(int_dirs(name), name)


def test_experts_kept_packed_match_hf(int_dirs):  # noqa: F811
    """Qwen2-MoE (a shared expert beside the routed ones), every expert's gate/up/down in
    int4 groups of 16, stacked [E, in / 2, (2,) out] with [E, groups, (2,) out] scales."""
    check_int_checkpoint(int_dirs("ct_w4a16_g16", "qwen2_moe"), "ct_w4a16_g16")
