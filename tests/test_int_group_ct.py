"""compressed-tensors integer checkpoints (models/int_group.py), packed by the
`compressed-tensors` library itself (tests/int_checkpoints.py): pack-quantized W4A16 in
groups of 32 (symmetric, Kimi K2-Thinking's scheme) and of 128 with packed zero points,
W8A16 in groups of 128, and int-quantized W8A8 (per channel, run weight-only). Each kept
packed and HF-exact on its dequantized twin, which the library's decompressor writes.
Experts: tests/test_int_group_experts.py."""

import pytest

pytest.importorskip("torch", reason="the Hugging Face reference and the writer need torch (the test extra)")
pytest.importorskip("compressed_tensors", reason="the writer packs with compressed-tensors (the test extra)")
from test_int_group import check_int_checkpoint, int_dirs  # noqa: F401 (the fixture)


@pytest.mark.parametrize("name", ["ct_w4a16", "ct_w4a16_asym", "ct_w8a16", "ct_w8a8"])
def test_int_checkpoint_matches_hf_on_its_dequantized_weights(int_dirs, name):  # noqa: F811
    check_int_checkpoint(int_dirs(name), name)

