"""Integer checkpoints through the Engine (tests/family_layouts.py's prompts and checks):
GPTQ act order (packed 4-bit codes, replicated group scales, g_idx split with the inputs)
kept as int_group: one device == chunked == prefix-cached == mesh.tensor=2 ==
mesh.stage=2 == engine.scan_layers (experts: tests/test_int_group_moe_layouts.py; HF parity and the
dequantized load: tests/test_int_group*.py)."""

import pytest

pytest.importorskip("torch", reason="the checkpoint writer needs torch (the test extra)")
from family_layouts import LAYOUTS, check_layouts, run_layouts
from hf_models import make_hf_checkpoint
from int_checkpoints import write_int

INT_LAYOUTS = {name: LAYOUTS[name] for name in ("whole", "chunked", "prefix", "tensor2", "stage2", "scan")}


def int_checkpoint(tmp_path, name: str, arch: str = "llama") -> str:
    shape = dict(hidden_size=128, intermediate_size=256) if arch == "llama" else {}
    plain = make_hf_checkpoint(str(tmp_path / arch), arch, **shape)
    return write_int(plain, str(tmp_path / name), name)


def test_int_group_act_order_layouts(tmp_path):
    model = int_checkpoint(tmp_path, "gptq_act_order")
    check_layouts(run_layouts(model, INT_LAYOUTS, devices=2), "llama",
                  ("chunked", "prefix", "tensor2", "stage2", "scan"))


