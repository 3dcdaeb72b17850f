"""AFMoE (Arcee Trinity) beyond tests/test_moe_parity.py's HF parity (MOE_KWARGS "afmoe":
f32 logits and greedy tokens equal to transformers'): each feature the family adds moves
the logits far past that tolerance when skipped, and the Engine gives the same tokens in
every layout the capability table lets it run, on 4 fake CPU devices."""

import pytest

from family_layouts import LAYOUTS, check_layouts, run_layouts
from hf_models import make_hf_checkpoint

# A port that skipped the feature (the config changed as named, the loaded weights kept):
# the 300-token prompt's last logits move by more than 1e-3 relative.
AFMOE_ABLATIONS = {
    "gate": dict(attn_gate_proj=False),  # no output gate
    "nope": dict(nope_layers=()),  # rope on the global layers too
    "window": dict(layer_types=(), sliding_window=None),  # every layer global
    "mup": dict(embed_scale=1.0),
    "route-scale": dict(routed_scaling=1.0),
    "selection-bias": dict(router_bias=False),
    "post-norms": dict(norm_layout="pre"),
    "qk-norm": dict(qk_norm="none"),
}


@pytest.fixture(scope="module")
def afmoe(tmp_path_factory):
    return make_hf_checkpoint(str(tmp_path_factory.mktemp("afmoe") / "afmoe"), "afmoe")


@pytest.mark.slow  # 47 s in a full run (2026-12-07, 2 loaded cores)
@pytest.mark.parametrize("name", sorted(AFMOE_ABLATIONS))
def test_each_afmoe_feature_changes_the_logits(afmoe, name):
    from test_family_parity import check_feature_changes_the_logits

    check_feature_changes_the_logits(afmoe, AFMOE_ABLATIONS[name], f"afmoe-{name}")


AFMOE_LAYOUTS = {**{name: LAYOUTS[name] for name in ("whole", "chunked", "prefix", "int8")},
                 "expert4": {"mesh.expert": 4},
                 "expert2_tensor2": {"mesh.expert": 2, "mesh.tensor": 2},
                 "expert2_sequence2": {"mesh.expert": 2, "mesh.sequence": 2}}


@pytest.mark.slow  # 116 s in a full run (2026-12-07, 2 loaded cores)
def test_afmoe_layouts(tmp_path):
    """Three layers: dense sliding (24-token window, roped), sparse global (NoPE), sparse
    sliding; 16-token chunks reach into two earlier ones through the window, the output
    gate's heads split over expert x tensor; int8 weights (the gate projection's too) and
    KV stay close."""
    model = make_hf_checkpoint(str(tmp_path / "afmoe"), "afmoe", num_hidden_layers=3)
    results = run_layouts(model, AFMOE_LAYOUTS, devices=4)
    check_layouts(results, "afmoe", ("chunked", "prefix", "expert4", "expert2_tensor2", "expert2_sequence2"))
