"""Integer checkpoints of a mixture of experts through the Engine (tests/family_layouts.py's
prompts and checks): GPTQ on Qwen3-MoE's experts and dense layer, groups of 16 so a
32-wide expert splits whole over mesh.tensor = 2, kept packed: one device == mesh.expert = 2
(each rank dequantizes its own experts) == mesh.tensor = 2 (each its groups of the down
projection's inputs)."""

import pytest

pytest.importorskip("torch", reason="the checkpoint writer needs torch (the test extra)")
from family_layouts import LAYOUTS, check_layouts, run_layouts
from test_int_group_layouts import int_checkpoint


def test_int_group_experts_layouts(tmp_path):
    model = int_checkpoint(tmp_path, "gptq_g16", "qwen3_moe")
    layouts = {"whole": LAYOUTS["whole"], "tensor2": LAYOUTS["tensor2"], "expert2": {"mesh.expert": 2}}
    check_layouts(run_layouts(model, layouts, devices=2), "qwen3_moe", ("tensor2", "expert2"))
