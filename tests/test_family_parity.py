"""Every family of models/families/ against Hugging Face transformers, random-init
checkpoints with shapes the tests choose (tests/hf_models.py FAMILY_KWARGS): f32 last-row
logits within 1e-5 relative and greedy tokens equal to HF's generate; bf16 no further from
the float64 truth than 1.25x HF's own bf16 (the method of tests/test_model_parity.py, which
covers Llama, Mistral and Qwen2). Prompts of 64 and 300 tokens cross the sliding windows
(24) of Gemma 2/3 and Phi-3 checkpoints."""

import dataclasses

import pytest
torch = pytest.importorskip("torch", reason="the Hugging Face reference needs torch (the test extra)")
from flax import nnx

from hf_models import FAMILY_KWARGS, load_hf
from jaxfill.models.checkpoint import load_hf_params
from jaxfill.models.families.registry import config_from_hf, new_model
from test_model_parity import (check_bf16_at_the_noise_floor, check_greedy_matches_hf, hf_last_logits,
                               ours_last_logits, prompts, rel_l2)

FAMILIES = tuple(FAMILY_KWARGS)


@pytest.mark.parametrize("arch", FAMILIES)
def test_f32_logits_and_greedy_tokens_match_hf(hf_dirs, arch):
    config = config_from_hf(hf_dirs[arch])
    model = load_hf_params(hf_dirs[arch], config, progress=False)
    hf = load_hf(hf_dirs[arch])
    for length, tokens in prompts(config.vocab_size):
        err = rel_l2(ours_last_logits(model, config, tokens), hf_last_logits(hf, tokens))
        assert err <= 1e-5, (arch, length, err)
    check_greedy_matches_hf(model, config, hf, 24)


@pytest.mark.xla_attention  # bf16 rounding as the CPU default impl casts
@pytest.mark.parametrize("arch", FAMILIES)
def test_bf16_logits_at_the_noise_floor(hf_dirs, arch):
    check_bf16_at_the_noise_floor(hf_dirs[arch])


# What each family adds must change the logits of a prompt longer than the window: a
# port that ignored the field would pass the parity test only if the field were inert.
ABLATIONS = {
    "gemma2": dict(attn_soft_cap=None),
    "gemma2-final": dict(final_soft_cap=None),
    "gemma2-window": dict(layer_types=(), sliding_window=None),
    "gemma3-local-rope": dict(rope_local_theta=None),
    "gemma3-norm": dict(qk_norm="none"),
    "smollm3": dict(nope_layers=()),
    "olmo2": dict(qk_norm="none"),
    "olmo3-window": dict(layer_types=(), sliding_window=None),
    "olmo3-local-rope": dict(rope_local_theta=None),
    "qwen3": dict(rope_scaling=None),
    "seed_oss": dict(attention_bias=False),
    "seed_oss-out-bias": dict(attention_out_bias=False),
    "exaone4-nope": dict(nope_layers=()),
    "exaone4-window": dict(layer_types=(), sliding_window=None),
    "exaone4-norm": dict(qk_norm="none"),
    "ministral-window": dict(layer_types=(), sliding_window=None),
    "ministral3": dict(query_temperature_beta=0.0),
    "ministral3-yarn": dict(rope_scaling=None),
    "arcee": dict(hidden_act="silu"),
    "apertus": dict(hidden_act="relu2"),
    "apertus-norm": dict(qk_norm="none"),
    "glm-interleave": dict(rope_interleave=False),
    "glm-partial": dict(rotary_dim=0),
    "glm4-interleave": dict(rope_interleave=False),
    "glm4-post-norms": dict(norm_layout="pre"),
    "granite": dict(residual_scale=1.0),
    "ernie4_5": dict(rope_interleave=False),
    "hunyuan_v1_dense": dict(qk_norm_after_rope=False),
}


@pytest.mark.parametrize("name", sorted(ABLATIONS))
def test_each_family_feature_changes_the_logits(hf_dirs, name):
    check_feature_changes_the_logits(hf_dirs[name.split("-")[0]], ABLATIONS[name], name)


def check_feature_changes_the_logits(directory: str, ablation: dict, name: str) -> None:
    """The checkpoint's weights under the config with `ablation` (flat keys) move the
    300-token prompt's last logits by more than 1e-3 relative."""
    config = config_from_hf(directory)
    length, tokens = prompts(config.vocab_size)[-1]
    loaded = load_hf_params(directory, config, progress=False)
    changed = config.replace(**ablation)
    other = new_model(changed, nnx.Rngs(0))  # the loaded weights, less any the change drops
    weights = dict(nnx.to_flat_state(nnx.state(loaded)))
    for path, var in nnx.to_flat_state(nnx.state(other)):
        var.set_value(weights[path][...])
    base = ours_last_logits(loaded, config, tokens)
    assert rel_l2(ours_last_logits(other, changed, tokens), base) > 1e-3, name


def test_phi3_longrope_within_its_original_context(tmp_path):
    """Phi-3 128k's longrope: the short factors and the attention factor transformers
    derives (from max_position_embeddings / original), HF's logits and greedy tokens within
    original_max_position_embeddings, where the context is capped (past it transformers
    re-ropes the whole sequence with the long factors)."""
    from hf_models import make_hf_checkpoint

    rope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0 + 0.4 * i for i in range(8)],
            "long_factor": [2.0 + i for i in range(8)]}
    directory = make_hf_checkpoint(str(tmp_path / "phi3"), "phi3", original_max_position_embeddings=512,
                                   rope_parameters=rope)
    config = config_from_hf(directory)
    assert config.max_position_embeddings == 512
    model = load_hf_params(directory, config, progress=False)
    hf = load_hf(directory)
    for length, tokens in prompts(config.vocab_size):
        err = rel_l2(ours_last_logits(model, config, tokens), hf_last_logits(hf, tokens))
        assert err <= 1e-5, (length, err)
    check_greedy_matches_hf(model, config, hf, 24)
    unscaled = config.replace(rope_scaling=None)
    assert rel_l2(ours_last_logits(new_model_like(model, unscaled), unscaled, prompts(config.vocab_size)[-1][1]),
                  ours_last_logits(model, config, prompts(config.vocab_size)[-1][1])) > 1e-3


def new_model_like(loaded, config):
    """A model of `config` holding `loaded`'s weights (those it has)."""
    other = new_model(config, nnx.Rngs(0))
    weights = dict(nnx.to_flat_state(nnx.state(loaded)))
    for path, var in nnx.to_flat_state(nnx.state(other)):
        var.set_value(weights[path][...])
    return other


def test_gemma3_image_text_checkpoint_loads_as_its_text_tower(tmp_path):
    """A Gemma3ForConditionalGeneration directory as save_pretrained writes it (transformers-4
    names `language_model.model.*`, a vision tower and projector beside it): text-only
    prompts give HF's logits; the vision weights are skipped."""
    import transformers as tf

    from hf_models import HF_SMALL

    text = dict(HF_SMALL, **FAMILY_KWARGS["gemma3"][1], final_logit_softcapping=3.0)
    text.pop("initializer_range")
    cfg = tf.Gemma3Config(text_config=text, mm_tokens_per_image=4, image_token_index=500, boi_token_index=501,
                          eoi_token_index=502, vision_config=dict(hidden_size=16, intermediate_size=32,
                                                                  num_hidden_layers=1, num_attention_heads=2,
                                                                  image_size=28, patch_size=14))
    torch.manual_seed(0)
    hf = tf.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(str(tmp_path))
    config = config_from_hf(str(tmp_path))
    assert config.architecture == "Gemma3ForConditionalGeneration" and config.embeddings.final_soft_cap is None
    model = load_hf_params(str(tmp_path), config, progress=False)
    for length, tokens in prompts(config.vocab_size)[1:]:
        err = rel_l2(ours_last_logits(model, config, tokens), hf_last_logits(hf, tokens))
        assert err <= 1e-5, (length, err)
