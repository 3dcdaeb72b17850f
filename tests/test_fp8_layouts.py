"""FP8 block-scaled checkpoints through the Engine (tests/family_layouts.py's prompts and
checks): kept in fp8 (model.weight_dtype = fp8_block, from the checkpoint's
quantization_config), one device == chunked == prefix-cached == mesh.tensor=2 ==
mesh.stage=2 == the checkpoint dequantized at load (weight_dtype auto), and its int8
re-quantization runs close; DeepSeek V3 (MLA projections and experts in fp8) equal over
mesh.expert=2 and mesh.tensor=2, whose splits keep whole 8 x 8 blocks on each device.
Engine.stats() and the planner report the bytes the device holds."""

import jax
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the checkpoint writer needs torch (the test extra)")
from family_layouts import LAYOUTS, check_layouts, run_layouts
from fp8_checkpoints import write_fp8
from hf_models import make_hf_checkpoint

FP8_LAYOUTS = {**{name: LAYOUTS[name] for name in ("whole", "chunked", "prefix", "tensor2", "stage2", "int8")},
               "dequantized": {"model.weight_dtype": "auto"}}


def fp8_checkpoint(tmp_path, arch: str, block: tuple) -> str:
    plain = make_hf_checkpoint(str(tmp_path / arch), arch)
    return write_fp8(plain, str(tmp_path / f"{arch}_fp8"), block)


def test_fp8_block_llama_layouts(tmp_path):
    model = fp8_checkpoint(tmp_path, "llama", (16, 16))
    check_layouts(run_layouts(model, FP8_LAYOUTS, devices=2), "llama",
                  ("chunked", "prefix", "tensor2", "stage2", "dequantized"))


def test_fp8_block_deepseek_v3_experts_and_heads_split(tmp_path):
    model = fp8_checkpoint(tmp_path, "deepseek_v3", (8, 8))
    layouts = {"whole": LAYOUTS["whole"], "expert2": {"mesh.expert": 2}, "tensor2": {"mesh.tensor": 2},
               "dequantized": {"model.weight_dtype": "auto"}}
    check_layouts(run_layouts(model, layouts, devices=2), "deepseek_v3", ("expert2", "tensor2", "dequantized"))


def test_engine_stats_and_planner_report_the_fp8_bytes(tmp_path):
    from jaxfill.engine.engine import Engine
    from jaxfill.engine.planner.counts import weight_bytes
    from jaxfill.models.quant import param_bytes

    model = fp8_checkpoint(tmp_path, "llama", (16, 16))
    base = {"engine.num_pages": 8, "engine.max_model_len": 64, "engine.max_num_batched_tokens": 16,
            "engine.token_buckets": [16], "engine.max_num_seqs": 1, "mesh.cpu_split": False}
    fp8 = Engine.from_config("tiny", model_path=model, overrides=base, progress=False)
    plain = Engine.from_config("tiny", model_path=model, overrides={**base, "model.weight_dtype": "auto"},
                               progress=False)
    got, want = fp8.stats()["weight_bytes"], plain.stats()["weight_bytes"]
    assert got == weight_bytes(fp8.config.model) and want == weight_bytes(plain.config.model)
    c = fp8.config.model  # f32 projections -> 1 byte each plus an f32 scale per 16 x 16 block
    projections = c.num_layers * (c.hidden_size * (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim
                                  + 3 * c.hidden_size * c.intermediate_size)
    assert want - got == projections * (4 - 1) - projections * 4 // 256
    dtypes = {leaf.dtype for leaf in jax.tree.leaves(fp8.runner.state) if hasattr(leaf, "dtype")}
    assert np.dtype(ml_dtypes.float8_e4m3fn) in dtypes and got == param_bytes(fp8.runner.state)
