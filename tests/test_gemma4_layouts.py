"""Gemma 4 (its global layers with their own head dim, one KV head and V = K beside the
sliding ones) through the Engine: unchunked == chunked == prefix-cached == tensor=2 (the
one global KV head repeated for the split) == sequence=2, int8 weights + int8 KV close
(tests/family_layouts.py). Its layers differ in shape, so scan_layers and mesh.stage are
refused (engine/capabilities/table.py, the mixed_kv rows; tested here too). The E shape
(per-layer inputs, KV-sharing layers) in the same layouts. The MoE block
(experts beside the dense MLP) on 4 devices: prefix-cached == chunked == expert 4 ==
expert 2 x tensor 2, every expert's routed pairs counted."""

import pytest

from family_layouts import LAYOUTS, check_every_layout, check_layouts, run_layouts
from hf_models import make_hf_checkpoint
from jaxfill.engine.config import load_config
from jaxfill.models.config import ConfigError

GEMMA4_LAYOUTS = {k: v for k, v in LAYOUTS.items() if k not in ("scan", "stage2")}


@pytest.fixture(scope="module")
def gemma4_dir(tmp_path_factory):
    return make_hf_checkpoint(str(tmp_path_factory.mktemp("gemma4") / "gemma4"), "gemma4")


@pytest.mark.slow  # 41 s in a full run (2026-12-07, 2 loaded cores)
def test_every_layout_gives_the_same_tokens(gemma4_dir):
    check_every_layout(gemma4_dir, "gemma4", GEMMA4_LAYOUTS, ("chunked", "prefix", "tensor2", "sequence2"))


@pytest.mark.slow  # 39 s in a full run (2026-12-07, 2 loaded cores)
def test_e_model_layouts(tmp_path):
    """The E shape: the KV-sharing layers read pages the chunks and the cached prefix
    filled through their source layers."""
    directory = make_hf_checkpoint(str(tmp_path / "gemma4_e"), "gemma4_e")
    check_every_layout(directory, "gemma4_e", GEMMA4_LAYOUTS, ("chunked", "prefix", "tensor2", "sequence2"))


def test_moe_block_layouts(tmp_path):
    directory = make_hf_checkpoint(str(tmp_path / "gemma4_moe"), "gemma4_moe")
    layouts = {name: LAYOUTS[name] for name in ("whole", "chunked", "prefix")}
    layouts.update(expert4={"mesh.expert": 4}, expert2_tensor2={"mesh.expert": 2, "mesh.tensor": 2})
    check_layouts(run_layouts(directory, layouts, devices=4), "gemma4_moe",
                  ("chunked", "prefix", "expert4", "expert2_tensor2"))


@pytest.mark.parametrize("overrides", [{"engine.scan_layers": True}, {"mesh.stage": 2},
                                       {"engine.host_kv_cache_gb": 0.01}])
def test_layers_of_two_shapes_refuse_stacking_and_the_kv_tiers(gemma4_dir, overrides):
    key = next(iter(overrides))
    with pytest.raises((ConfigError, ValueError), match=key.split(".")[1]):
        load_config("tiny", overrides, model_path=gemma4_dir)
