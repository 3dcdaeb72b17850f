"""Llama 4 against Hugging Face transformers beyond test_moe_parity.py's
test_f32_logits_and_greedy_tokens_match_hf[llama4] (the CausalLM: f32 last-row logits of
the 1/7/64/300-token prompts within 1e-5, greedy tokens of HF generate across a chunk
boundary): the text tower of Llama4ForConditionalGeneration, and an ablation per feature
the family adds (each moves the 300-token prompt's last logits past 1e-3, far beyond the
parity tolerance, so a port that skipped it would fail parity)."""

import numpy as np
import pytest

from hf_models import MOE_KWARGS, make_hf_checkpoint
from jaxfill.models.checkpoint import load_hf_params
from jaxfill.models.families.registry import config_from_hf
from test_model_parity import hf_last_logits, ours_last_logits, prompts, rel_l2

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def llama4_dir(tmp_path_factory):
    return make_hf_checkpoint(str(tmp_path_factory.mktemp("llama4") / "llama4"), "llama4")


def test_text_tower_of_the_image_text_checkpoint_matches_hf(tmp_path):
    """Llama4ForConditionalGeneration with a tiny vision tower: its `language_model.*`
    tensors load, `vision_model.*` and `multi_modal_projector.*` are skipped, and the
    logits of text-only prompts are HF's."""
    import transformers as tf

    from hf_models import HF_SMALL

    text = dict(HF_SMALL, **MOE_KWARGS["llama4"][1])
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                  vision_output_dim=32, image_size=28, patch_size=14, projector_input_dim=32,
                  projector_output_dim=32)
    torch.manual_seed(0)
    hf = tf.Llama4ForConditionalGeneration(tf.Llama4Config(text_config=text, vision_config=vision)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(str(tmp_path))
    config = config_from_hf(str(tmp_path))
    assert config.architecture == "Llama4ForConditionalGeneration" and config.attention.attention_chunk == 32
    model = load_hf_params(str(tmp_path), config, progress=False)
    for length, tokens in prompts(config.vocab_size)[2:]:
        err = rel_l2(ours_last_logits(model, config, tokens), hf_last_logits(hf, tokens))
        assert err <= 1e-5, (length, err)


def test_config_reads_what_transformers_derives(llama4_dir):
    """no_rope_layer_interval 2: layers 1, 3 NoPE and global, 0, 2 chunked; moe_layers
    [1, 2]: 0, 3 dense with intermediate_size_mlp; the temperature on NoPE layers only."""
    from jaxfill.models.layer_settings import layer_settings

    c = config_from_hf(llama4_dir)
    assert c.attention.nope_layers == (1, 3) and c.attention.layer_types == ("chunked", "full", "chunked", "full")
    assert c.moe.dense_layers == (0, 3) and c.intermediate_size == 96 and c.moe.intermediate_size == 48
    assert c.moe.shared_expert_size == 48 and not c.moe.shared_expert_gate
    assert layer_settings(c).temperature.tolist() == [0.0, 0.5, 0.0, 0.5]
    assert layer_settings(c).windows == ((None, 32), (None, None))


# flat keys -> what a port without the feature would compute. Counting positions from 0
# instead of 1 (query_temperature_offset=0) moves them by 5.8e-4 only (one row in 16 steps
# early): past the parity tolerance (1e-5), which catches it, not past this check's 1e-3.
ABLATIONS = {
    "chunks": dict(layer_types=(), attention_chunk=None),
    "temperature": dict(query_temperature_beta=0.0),
    "temperature-nope-only": dict(query_temperature_nope_only=False),
    "qk-norm": dict(qk_norm="none", qk_norm_after_rope=False),
    "weights-on-inputs": dict(router_weights_inputs=False),
    "pairs": dict(rope_interleave=False),
}


@pytest.mark.slow  # 34 s in a full run (2026-12-07, 2 loaded cores)
@pytest.mark.parametrize("name", sorted(ABLATIONS))
def test_each_feature_changes_the_logits(llama4_dir, name):
    from test_family_parity import check_feature_changes_the_logits

    check_feature_changes_the_logits(llama4_dir, ABLATIONS[name], f"llama4-{name}")


def test_chunked_layers_see_only_their_chunk(llama4_dir):
    """The last row of a 64-token prompt (positions 32..63 its chunk) is unchanged when the
    tokens of the first chunk change on the roped layers alone... which they cannot be, the
    NoPE layers see every key: so instead, a model of only chunked layers gives the last
    row the same logits for any first chunk."""
    config = config_from_hf(llama4_dir).replace(layer_types=(), nope_layers=(), query_temperature_beta=0.0)
    model = load_hf_params(llama4_dir, config, progress=False)
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, config.vocab_size, 64)
    other = np.concatenate([rng.integers(0, config.vocab_size, 32), tokens[32:]])
    a, b = ours_last_logits(model, config, tokens), ours_last_logits(model, config, other)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
