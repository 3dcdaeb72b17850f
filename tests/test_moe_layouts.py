"""Mixtures of experts through the Engine: one device == chunked == prefix-cached ==
mesh.expert=4 == expert 2 x tensor 2 == expert 2 x sequence 2 == expert 2 x stage 2 (4
fake CPU devices), and expert 4 x data 2 == expert 2 x tensor 2 x data 2 (8 devices);
int8 weights (per expert) and int8 KV stay close. The prompts of tests/family_layouts.py
with 8 experts, top 2: the 3-token prompt leaves experts of some ranks without a token.
Qwen3-MoE, GLM-4.5 and ERNIE 4.5 (dense layers beside sparse ones), OLMoE, MiniMax-M2 and
Hunyuan, Phi-3.5-MoE (every layer sparse) and gpt-oss run a shorter list on 4 devices. Compiles dominate: one subprocess per model and device count, each engine
compiling one step bucket; the 8-device run of Mixtral compares against the 4-device
run's single-device reference instead of compiling its own."""

import pytest

from family_layouts import LAYOUTS, check_layouts, run_layouts
from hf_models import make_hf_checkpoint

# the plain, chunked, prefix-cached and int8 layouts of tests/family_layouts.py, plus experts
FOUR = {**{name: LAYOUTS[name] for name in ("whole", "chunked", "prefix", "int8")},
        "expert4": {"mesh.expert": 4},
        "expert2_tensor2": {"mesh.expert": 2, "mesh.tensor": 2},
        "expert2_sequence2": {"mesh.expert": 2, "mesh.sequence": 2},
        "expert2_stage2": {"mesh.expert": 2, "mesh.stage": 2}}
EIGHT = {
    "expert4_data2": {"mesh.expert": 4, "mesh.data": 2},
    "expert2_tensor2_data2": {"mesh.expert": 2, "mesh.tensor": 2, "mesh.data": 2},
}
# Fewer layers than tests/hf_models.py's presets (every unrolled layer lengthens every
# compile), keeping what each case is about; the expert counts are checked on every layer
# but the last, so each model keeps a sparse layer before its last one.
SHAPES = {
    # sparse, dense (the preset: sparse, dense, sparse); a sparse last layer, which may run
    # the sampled rows only, stays covered by Mixtral's and GLM's
    "qwen3_moe": dict(num_hidden_layers=2, mlp_only_layers=[1]),
    # one 24-token sliding window layer and one full layer (the preset: two of each)
    "gpt_oss": dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"]),
    # sparse, dense (the preset: dense, sparse, dense, sparse)
    "ernie4_5_moe": dict(num_hidden_layers=2, moe_layer_start_index=0, moe_layer_end_index=0, moe_layer_interval=1),
}


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return make_hf_checkpoint(str(tmp_path_factory.mktemp("moe") / "mixtral"), "mixtral")


@pytest.fixture(scope="module")
def mixtral_four(mixtral):
    """FOUR's results on 4 devices: test_four_devices checks them, test_eight_devices
    takes the reference ("whole", one device) from them."""
    return run_layouts(mixtral, FOUR, devices=4)


@pytest.mark.slow  # 48 s in a full run (2026-12-07, 2 loaded cores)
def test_four_devices(mixtral_four):
    check_layouts(mixtral_four, "mixtral", tuple(k for k in FOUR if k not in ("whole", "int8")))


@pytest.mark.slow  # 32 s in a full run (2026-12-07, 2 loaded cores)
@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe", "ernie4_5_moe"])
def test_dense_and_sparse_layers(tmp_path, arch):
    """A dense layer beside sparse ones; GLM: sigmoid grouped routing, shared experts,
    partial rotary; ERNIE 4.5: a softmax router with a selection bias (its f32 param split
    with nothing), shared experts, rope on interleaved pairs with heads split over tensor."""
    model = make_hf_checkpoint(str(tmp_path / arch), arch, **SHAPES.get(arch, {}))
    layouts = {name: FOUR[name] for name in ("whole", "prefix", "expert4", "expert2_tensor2")}
    check_layouts(run_layouts(model, layouts, devices=4), arch, ("prefix", "expert4", "expert2_tensor2"))


@pytest.mark.slow  # 37 s in a full run (2026-12-07, 2 loaded cores)
@pytest.mark.parametrize("arch", ["olmoe", "minimax_m2", "hunyuan_v1_moe", "phimoe"])
def test_every_layer_sparse(tmp_path, arch):
    """Every MLP a mixture of experts. OLMoE and MiniMax-M2: q/k norms over the whole
    projection, whose heads split over expert x tensor; MiniMax-M2's sigmoid router with
    its correction bias and partial rope; Hunyuan: q/k norms after rope, a shared MLP;
    Phi-3.5-MoE: sparsemixer, LayerNorms, the LM head's bias split with the vocabulary."""
    model = make_hf_checkpoint(str(tmp_path / arch), arch, **SHAPES.get(arch, {}))
    layouts = {name: FOUR[name] for name in ("whole", "prefix", "expert4", "expert2_tensor2")}
    check_layouts(run_layouts(model, layouts, devices=4), arch, ("prefix", "expert4", "expert2_tensor2"))


def test_gpt_oss(tmp_path):
    """Attention sinks split with the heads over expert x tensor, in chunked prefill and
    decode; biased experts whose down bias is added once per expert, not per tensor rank."""
    model = make_hf_checkpoint(str(tmp_path / "gpt_oss"), "gpt_oss", **SHAPES["gpt_oss"])
    layouts = {name: FOUR[name] for name in ("whole", "chunked", "prefix", "expert2_tensor2", "int8")}
    check_layouts(run_layouts(model, layouts, devices=4), "gpt_oss", ("chunked", "prefix", "expert2_tensor2"))


@pytest.mark.slow  # 36 s in a full run (2026-12-07, 2 loaded cores)
def test_eight_devices(mixtral, mixtral_four):
    r = {"whole": mixtral_four["whole"], **run_layouts(mixtral, EIGHT, devices=8)}
    check_layouts(r, "mixtral", tuple(EIGHT))
