"""Mixtures of experts through the Engine: one device == chunked == prefix-cached ==
mesh.expert=4 == expert 2 x tensor 2 == expert 2 x sequence 2 == expert 2 x stage 2 (4
fake CPU devices), and expert 4 x data 2 == expert 2 x tensor 2 x data 2 (8 devices);
int8 weights (per expert) and int8 KV stay close. The prompts of tests/family_layouts.py
with 8 experts, top 2: the 3-token prompt leaves experts of some ranks without a token.
Qwen3-MoE and GLM-4.5 (dense first layers) and gpt-oss run a shorter list on 4 devices. Over a
minute: one subprocess per device count, each compiling every layout's buckets."""

import pytest

from family_layouts import LAYOUTS, check_every_layout
from hf_models import make_hf_checkpoint

# the plain, chunked, prefix-cached and int8 layouts of tests/family_layouts.py, plus experts
FOUR = {**{name: LAYOUTS[name] for name in ("whole", "chunked", "prefix", "int8")},
        "expert4": {"mesh.expert": 4},
        "expert2_tensor2": {"mesh.expert": 2, "mesh.tensor": 2},
        "expert2_sequence2": {"mesh.expert": 2, "mesh.sequence": 2},
        "expert2_stage2": {"mesh.expert": 2, "mesh.stage": 2}}
EIGHT = {
    "whole": LAYOUTS["whole"],
    "expert4_data2": {"mesh.expert": 4, "mesh.data": 2},
    "expert2_tensor2_data2": {"mesh.expert": 2, "mesh.tensor": 2, "mesh.data": 2},
}


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return make_hf_checkpoint(str(tmp_path_factory.mktemp("moe") / "mixtral"), "mixtral")


def test_four_devices(mixtral):
    check_every_layout(mixtral, "mixtral", FOUR, tuple(k for k in FOUR if k not in ("whole", "int8")), devices=4)


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_dense_and_sparse_layers(tmp_path, arch):
    """A dense layer beside sparse ones; GLM: sigmoid grouped routing, shared experts,
    partial rotary."""
    model = make_hf_checkpoint(str(tmp_path / arch), arch)
    layouts = {name: FOUR[name] for name in ("whole", "prefix", "expert4", "expert2_tensor2")}
    check_every_layout(model, arch, layouts, ("prefix", "expert4", "expert2_tensor2"), devices=4)


def test_gpt_oss(tmp_path):
    """Attention sinks split with the heads over expert x tensor, in chunked prefill and
    decode; biased experts whose down bias is added once per expert, not per tensor rank."""
    model = make_hf_checkpoint(str(tmp_path / "gpt_oss"), "gpt_oss")
    layouts = {name: FOUR[name] for name in ("whole", "chunked", "prefix", "expert2_tensor2", "int8")}
    check_every_layout(model, "gpt_oss", layouts, ("chunked", "prefix", "expert2_tensor2"), devices=4)


def test_eight_devices(mixtral):
    check_every_layout(mixtral, "mixtral", EIGHT, ("expert4_data2", "expert2_tensor2_data2"), devices=8)
