"""Mistral 4 beyond tests/test_moe_parity.py's HF parity (MOE_KWARGS "mistral4": f32 logits
and greedy tokens equal to transformers'): each feature it adds to DeepSeek V3's MLA + MoE
moves the logits far past that tolerance when skipped, and the Engine gives the same
tokens in every layout it runs here, on 4 fake CPU devices (MLA's int8 weights:
tests/test_int8_mla_linear.py)."""

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


@pytest.mark.slow  # 32 s in a full run (2026-12-07, 2 loaded cores)
@pytest.mark.parametrize("name", sorted(MISTRAL4_ABLATIONS))
def test_each_mistral4_feature_changes_the_logits(mistral4, name):
    from test_family_parity import check_feature_changes_the_logits

    check_feature_changes_the_logits(mistral4, MISTRAL4_ABLATIONS[name], f"mistral4-{name}")


def chunks(n: int) -> dict:
    return {"engine.enable_prefix_caching": False, "engine.max_num_batched_tokens": n, "engine.token_buckets": [n]}


MISTRAL4_LAYOUTS = {"whole": LAYOUTS["whole"], "chunk7": chunks(7), "prefix": LAYOUTS["prefix"],
                    "tensor4": {"mesh.tensor": 4}, "expert2_tensor2": {"mesh.expert": 2, "mesh.tensor": 2},
                    "expert2_sequence2": {"mesh.expert": 2, "mesh.sequence": 2},
                    "int8": {"engine.kv_cache_dtype": "int8"}}


@pytest.mark.slow  # 39 s in a full run (2026-12-07, 2 loaded cores)
def test_mistral4_layouts(tmp_path):
    """Two layers: a dense one, then softmax grouped routing beside a shared expert; the
    query temperature steps every 16 positions, so 7-token chunks and the prefix-cached
    resume cross its boundaries; the heads split 4 ways or over expert x tensor, the rows
    over sequence; an int8 latent cache stays close."""
    model = make_hf_checkpoint(str(tmp_path / "mistral4"), "mistral4", num_hidden_layers=2)
    results = run_layouts(model, MISTRAL4_LAYOUTS, devices=4)
    check_layouts(results, "mistral4", ("chunk7", "prefix", "tensor4", "expert2_tensor2", "expert2_sequence2"))


@pytest.mark.parametrize("tied", [True, False])
def test_text_tower_of_mistral3_conditional_generation_matches_hf(tmp_path, tied):
    """Mistral3ForConditionalGeneration with a tiny Pixtral tower and a Mistral 4 text
    config, as Mistral Small 4 ships: `language_model.model.*` loads, `vision_tower.*` and
    `multi_modal_projector.*` are skipped, the outer tie_word_embeddings ties the head, and
    the logits of text-only prompts are HF's; a Mistral 3 text tower is refused by name."""
    import json

    import transformers as tf

    from hf_models import HF_SMALL, MOE_KWARGS, torch
    from jaxfill.models.checkpoint import load_hf_params
    from jaxfill.models.config import ConfigError
    from jaxfill.models.families.registry import config_from_hf
    from test_model_parity import hf_last_logits, ours_last_logits, prompts, rel_l2

    text = dict(HF_SMALL, **{**MOE_KWARGS["mistral4"][1], "num_hidden_layers": 2}, model_type="mistral4")
    vision = dict(model_type="pixtral", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=64, image_size=28, patch_size=14, head_dim=16)
    torch.manual_seed(0)
    hf = tf.Mistral3ForConditionalGeneration(tf.Mistral3Config(text_config=text, vision_config=vision,
                                                               tie_word_embeddings=tied)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(str(tmp_path))
    config = config_from_hf(str(tmp_path))
    assert config.architecture == "Mistral3ForConditionalGeneration" and config.embeddings.tied == tied
    model = load_hf_params(str(tmp_path), config, progress=False)
    for length, tokens in prompts(config.vocab_size)[2:]:
        err = rel_l2(ours_last_logits(model, config, tokens), hf_last_logits(hf, tokens))
        assert err <= 1e-5, (length, err)
    raw = json.load(open(tmp_path / "config.json"))
    raw["text_config"]["model_type"] = "ministral3"
    with pytest.raises(ConfigError, match="text_config.model_type='ministral3'"):
        config_from_hf(raw)
