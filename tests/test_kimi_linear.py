"""Kimi Linear (KDA x3 : NoPE MLA, DeepSeek V3's MoE) against Hugging Face transformers on a
random-init checkpoint (tests/hf_models.py HYBRID_KWARGS["kimi_linear"]: dt_bias, A_log,
the norms and the router's correction bias all off their defaults, routed_scaling 1.8, 4
expert groups of which the best 2 are chosen): f32 last-row logits within 1e-5 relative,
greedy tokens equal to HF's generate; a prefill cut into chunks (the state carried through
its slot) equals it whole; a fresh sequence ignores what its slot holds. Each feature the
family adds moves the logits when changed (a port that skipped it would not match); the
published config.json's layout (1-indexed linear_attn_config lists) maps as transformers
reads it; what is not built is refused by name."""

import numpy as np
import pytest
from flax import nnx

from hf_models import load_hf
from jaxfill.models.config import ConfigError
from jaxfill.models.families.registry import config_from_hf, new_model, param_count
from test_family_parity import check_feature_changes_the_logits
from test_hybrid_parity import checkpoint, check_chunked_equals_whole, check_fresh_sequence_ignores_its_slot
from test_model_parity import check_greedy_matches_hf, hf_last_logits, ours_last_logits, prompts, rel_l2


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return checkpoint(tmp_path_factory, "kimi_linear")


def test_f32_logits_and_greedy_tokens_match_hf(kimi):
    directory, config, model = kimi
    assert config.linear.kind == "kda" and config.linear.layers == (0, 1, 3) and config.mla.enabled
    assert config.attention.nope_layers == (2,) and config.moe.dense_layers == (0,) and config.moe.groups == 4
    hf = load_hf(directory)
    # HF keeps the router's correction bias as a buffer; we count it as a parameter
    buffers = sum(b.numel() for name, b in hf.named_buffers() if name.endswith("correction_bias"))
    assert param_count(config) == sum(p.numel() for p in hf.parameters()) + buffers
    for length, tokens in prompts(config.vocab_size):
        err = rel_l2(ours_last_logits(model, config, tokens), hf_last_logits(hf, tokens))
        assert err <= 1e-5, (length, err)
    check_greedy_matches_hf(model, config, hf, 16)


@pytest.mark.parametrize("chunk", [1, 7])
def test_chunked_prefill_equals_whole(kimi, chunk):
    check_chunked_equals_whole(kimi[2], kimi[1], chunk)


@pytest.mark.slow  # 33 s in a full run (2026-12-07, 2 loaded cores)
def test_a_fresh_sequence_ignores_what_its_slot_holds(kimi):
    check_fresh_sequence_ignores_its_slot(kimi[2], kimi[1])


@pytest.mark.parametrize("name, ablation", [
    ("rope on the latent attention", dict(nope_layers=())),
    ("no selection bias", dict(router_bias=False)),
    ("routed weights unscaled", dict(routed_scaling=1.0)),
    ("no expert groups", dict(router_groups=1, router_topk_groups=1)),
    ("no shared expert", dict(shared_expert_size=0)),
])
def test_each_config_feature_changes_the_logits(kimi, name, ablation):
    check_feature_changes_the_logits(kimi[0], ablation, name)


# KDA's own parts, as weights: each set to what a port that skipped it would compute with
WEIGHT_ABLATIONS = {
    "decay per head, not per channel": ("dt_bias", lambda w: np.broadcast_to(w.mean(-1, keepdims=True), w.shape)),
    "no decay scale (A_log = 0)": ("a_log", np.zeros_like),
    "no output gate": ("g_b", lambda w: np.full_like(w, 0.0)),
    "no gated norm weight": ("norm", np.ones_like),
    "no short convolution on k": ("conv_k", lambda w: np.concatenate([np.zeros_like(w[..., :-1]),
                                                                      np.ones_like(w[..., -1:])], -1)),
}


def with_changed(model, config, leaf: str, change, layer: int | None = None):
    """A copy of `model` whose mixer params named `leaf` (in `layer` only, if given) are `change`d."""
    other = new_model(config, nnx.Rngs(1))
    params = dict(nnx.to_flat_state(nnx.state(other)))
    for path, var in nnx.to_flat_state(nnx.state(model)):
        value = np.asarray(var[...])
        hit = path[-1] == leaf and path[2] == "attn" and layer in (None, path[1])
        params[path].set_value(change(value) if hit else value)
    return other


@pytest.mark.parametrize("name", list(WEIGHT_ABLATIONS))
def test_each_kda_part_changes_the_logits(kimi, name):
    _, config, model = kimi
    leaf, change = WEIGHT_ABLATIONS[name]
    length, tokens = prompts(config.vocab_size)[-1]
    base = ours_last_logits(model, config, tokens)
    same = ours_last_logits(with_changed(model, config, leaf, lambda w: w), config, tokens)
    np.testing.assert_array_equal(np.asarray(same), np.asarray(base))  # the copy is the model
    assert rel_l2(ours_last_logits(with_changed(model, config, leaf, change), config, tokens), base) > 1e-3, name


# The published Kimi-Linear-48B-A3B config.json's fields (weights aside), as Moonshot writes them
PUBLISHED = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 163840,
    "hidden_size": 2304, "intermediate_size": 9216, "moe_intermediate_size": 1024, "num_hidden_layers": 27,
    "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 72, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
    "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1, "num_expert_group": 1, "topk_group": 1,
    "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "moe_layer_freq": 1,
    "routed_scaling_factor": 2.446, "first_k_dense_replace": 1, "num_nextn_predict_layers": 0,
    "model_max_length": 1048576, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 163584, "eos_token_id": 163586,
    "pad_token_id": 163839, "torch_dtype": "bfloat16", "use_cache": True,
    "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128,
                           "kda_layers": [n for n in range(1, 28) if n not in (4, 8, 12, 16, 20, 24, 27)],
                           "num_heads": 32, "short_conv_kernel_size": 4},
}


def test_the_published_config_maps_as_transformers_reads_it():
    """linear_attn_config's 1-indexed lists, the attribute_map spellings, layer 0 dense."""
    c = config_from_hf(PUBLISHED)
    assert c.attention.nope_layers == (3, 7, 11, 15, 19, 23, 26) and len(c.linear.layers) == 20
    assert (c.linear.num_value_heads, c.linear.key_head_dim, c.linear.conv_kernel) == (32, 128, 4)
    assert (c.moe.num_experts, c.moe.experts_per_token, c.moe.dense_layers, c.moe.shared_expert_size) == \
        (256, 8, (0,), 1024)
    assert c.moe.routed_scaling == 2.446 and c.max_position_embeddings == 1048576 and c.mla.q_lora_rank == 0


@pytest.mark.parametrize("field, value", [("mla_use_nope", False), ("moe_router_activation_func", "softmax"),
                                          ("moe_layer_freq", 2), ("hidden_act", "gelu"),
                                          ("num_nextn_predict_layers", 1)])
def test_what_is_not_built_is_refused_by_name(field, value):
    with pytest.raises(ConfigError, match=field):
        config_from_hf({**PUBLISHED, field: value})


def test_linear_impl_pallas_tpu_is_refused_for_kda():
    with pytest.raises(ConfigError, match="linear_impl = pallas_tpu"):
        config_from_hf(PUBLISHED).replace(linear_impl="pallas_tpu")


def test_the_preset_is_the_published_config():
    """configs/kimi_linear_48b_a3b.toml is what the published config.json maps to."""
    from jaxfill.engine.config import load_config

    preset = load_config("kimi_linear_48b_a3b").model
    published = config_from_hf(PUBLISHED)
    assert preset.replace(dtype="bfloat16", tokenizer="hf") == published.replace(dtype="bfloat16", tokenizer="hf")
