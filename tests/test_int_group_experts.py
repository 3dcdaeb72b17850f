"""Integer checkpoints of mixtures of experts (models/int_group.py), written with the
`compressed-tensors` library (tests/int_checkpoints.py): each expert's codes stacked
[E, in / 2, (2,) out] beside [E, groups, (2,) out] scales, dequantized per rank inside
the expert-parallel matmul; HF-exact on the dequantized twin. W4A16 on a Qwen2-MoE's
experts and shared expert, and Kimi K2-Thinking's layout (routed experts alone packed,
the rest in `ignore`) on a DeepSeek V3."""

import pytest

pytest.importorskip("torch", reason="the Hugging Face reference and the writer need torch (the test extra)")
pytest.importorskip("compressed_tensors", reason="the writer packs with compressed-tensors (the test extra)")
from test_int_group import check_int_checkpoint, int_dirs  # noqa: F401 (the fixture)


def test_experts_kept_packed_match_hf(int_dirs):  # noqa: F811
    """Qwen2-MoE (a shared expert beside the routed ones), every expert's gate/up/down in
    int4 groups of 16, stacked [E, in / 2, (2,) out] with [E, groups, (2,) out] scales."""
    check_int_checkpoint(int_dirs("ct_w4a16_g16", "qwen2_moe"), "ct_w4a16_g16")


def test_kimi_k2_thinking_layout_routed_experts_alone(int_dirs):  # noqa: F811
    """DeepSeek V3 (MLA, a dense first layer, shared experts) with Kimi K2-Thinking's
    quantization_config: W4A16 groups of 32 on the routed experts, attention, dense MLP and
    shared experts in its ignore list (regexes) and loaded unquantized beside them."""
    check_int_checkpoint(int_dirs("ct_experts_only", "deepseek_v3"), "ct_experts_only")
