"""Mistral 4 beyond tests/test_moe_parity.py's HF parity (MOE_KWARGS "mistral4": f32 logits
and greedy tokens equal to transformers'): each feature it adds to DeepSeek V3's MLA + MoE
moves the logits far past that tolerance when skipped, and the Engine gives the same
tokens in every layout the capability table lets it run (int8 weights are refused for MLA),
on 4 fake CPU devices."""

import pytest

from family_layouts import LAYOUTS, check_layouts, run_layouts
from hf_models import make_hf_checkpoint

# A port that skipped the feature (the config changed as named, the loaded weights kept):
# the 300-token prompt's last logits move by more than 1e-3 relative.
MISTRAL4_ABLATIONS = {
    "temperature": dict(query_temperature_beta=0.0),
    "groups": dict(router_groups=1, router_topk_groups=1),
    "route-scale": dict(routed_scaling=1.0),
    "renormalised": dict(router_renormalize=False),
}


@pytest.fixture(scope="module")
def mistral4(tmp_path_factory):
    return make_hf_checkpoint(str(tmp_path_factory.mktemp("mistral4") / "mistral4"), "mistral4")


@pytest.mark.parametrize("name", sorted(MISTRAL4_ABLATIONS))
def test_each_mistral4_feature_changes_the_logits(mistral4, name):
    from test_family_parity import check_feature_changes_the_logits

    check_feature_changes_the_logits(mistral4, MISTRAL4_ABLATIONS[name], f"mistral4-{name}")


def chunks(n: int) -> dict:
    return {"engine.enable_prefix_caching": False, "engine.max_num_batched_tokens": n, "engine.token_buckets": [n]}


MISTRAL4_LAYOUTS = {"whole": LAYOUTS["whole"], "chunk7": chunks(7), "prefix": LAYOUTS["prefix"],
                    "tensor2": {"mesh.tensor": 2}, "sequence2": LAYOUTS["sequence2"],
                    "expert2_tensor2": {"mesh.expert": 2, "mesh.tensor": 2},
                    "int8": {"engine.kv_cache_dtype": "int8"}}


def test_mistral4_layouts(tmp_path):
    """Two layers: a dense one, then softmax grouped routing beside a shared expert; the
    query temperature steps every 16 positions, so 7-token chunks and the prefix-cached
    resume cross its boundaries; an int8 latent cache stays close."""
    model = make_hf_checkpoint(str(tmp_path / "mistral4"), "mistral4", num_hidden_layers=2)
    results = run_layouts(model, MISTRAL4_LAYOUTS, devices=4)
    check_layouts(results, "mistral4", ("chunk7", "prefix", "tensor2", "sequence2", "expert2_tensor2"))
