"""Ling 2.5 (BailingHybridForCausalLM: KDA x3 : roped MLA with a per-head gate, DeepSeek V3's
MoE) against Hugging Face transformers on a random-init checkpoint (tests/hf_models.py
HYBRID_KWARGS["bailing_hybrid"]: the bounded decay at -3, not -5; dt_bias, A_log, the
norms and the router's correction bias off their defaults; routed_scaling 1.8, 4 expert
groups of which the best 2 are chosen): f32 last-row logits within 1e-5 relative, greedy
tokens equal to HF's generate; a prefill cut into chunks equals it whole; a fresh sequence
ignores what its slot holds. Each feature the family adds moves the logits when changed;
what is not built is refused by name."""

import numpy as np
import pytest

from hf_models import load_hf
from jaxfill.models.config import ConfigError
from jaxfill.models.families.registry import config_from_hf, param_count
from test_family_parity import check_feature_changes_the_logits
from test_hybrid_parity import checkpoint, check_chunked_equals_whole, check_fresh_sequence_ignores_its_slot
from test_kimi_linear import with_changed
from test_model_parity import check_greedy_matches_hf, hf_last_logits, ours_last_logits, prompts, rel_l2


@pytest.fixture(scope="module")
def ling(tmp_path_factory):
    return checkpoint(tmp_path_factory, "bailing_hybrid")


def test_f32_logits_and_greedy_tokens_match_hf(ling):
    directory, config, model = ling
    assert config.linear.kind == "kda" and config.linear.layers == (0, 1, 3) and config.mla.head_gate
    assert config.linear.full_rank_gates and config.linear.gate_lower_bound == -3.0
    assert config.attention.nope_layers == () and config.attention.rope_interleave and config.moe.groups == 4
    hf = load_hf(directory)
    # HF keeps the router's correction bias as a buffer; we count it as a parameter
    buffers = sum(b.numel() for name, b in hf.named_buffers() if name.endswith("correction_bias"))
    assert param_count(config) == sum(p.numel() for p in hf.parameters()) + buffers
    for length, tokens in prompts(config.vocab_size):
        err = rel_l2(ours_last_logits(model, config, tokens), hf_last_logits(hf, tokens))
        assert err <= 1e-5, (length, err)
    check_greedy_matches_hf(model, config, hf, 16)


@pytest.mark.parametrize("chunk", [1, 7])
def test_chunked_prefill_equals_whole(ling, chunk):
    check_chunked_equals_whole(ling[2], ling[1], chunk)


def test_a_fresh_sequence_ignores_what_its_slot_holds(ling):
    check_fresh_sequence_ignores_its_slot(ling[2], ling[1])


@pytest.mark.parametrize("name, ablation", [
    ("no rope on the latent attention", dict(nope_layers=(2,))),
    ("Kimi's unbounded decay", dict(linear_gate_lower_bound=None)),
    ("another decay bound", dict(linear_gate_lower_bound=-5.0)),
    ("no selection bias", dict(router_bias=False)),
    ("routed weights unscaled", dict(routed_scaling=1.0)),
    ("no expert groups", dict(router_groups=1, router_topk_groups=1)),
])
def test_each_config_feature_changes_the_logits(ling, name, ablation):
    check_feature_changes_the_logits(ling[0], ablation, name)


# The parts Ling adds, as weights: each set to what a port that skipped it would compute with
WEIGHT_ABLATIONS = {
    "MLA head gate weights zeroed (every gate 1/2)": ("g", 2, np.zeros_like),
    "no KDA output gate": ("g", 0, np.zeros_like),
    "decay per head, not per channel": ("dt_bias", 0, lambda w: np.broadcast_to(w.mean(-1, keepdims=True), w.shape)),
    "no decay scale (A_log = 0)": ("a_log", 0, np.zeros_like),
}


@pytest.mark.parametrize("name", list(WEIGHT_ABLATIONS))
def test_each_part_changes_the_logits(ling, name):
    _, config, model = ling
    leaf, layer, change = WEIGHT_ABLATIONS[name]
    length, tokens = prompts(config.vocab_size)[-1]
    base = ours_last_logits(model, config, tokens)
    changed = with_changed(model, config, leaf, change, layer=layer)
    assert rel_l2(ours_last_logits(changed, config, tokens), base) > 1e-3, name


def test_what_is_not_built_is_refused_by_name(ling):
    import json
    import os

    with open(os.path.join(ling[0], "config.json")) as f:
        hf = json.load(f)
    for field, value in [("expert_swiglu_limit_list", [0, 7.0, 0, 0]), ("share_expert_swiglu_limit_list", [0, 0, 0, 7]),
                         ("hidden_act", "gelu"), ("attention_bias", True)]:
        with pytest.raises(ConfigError, match=field):
            config_from_hf({**hf, field: value})
    assert config_from_hf({**hf, "kda_safe_gate": False}).linear.gate_lower_bound is None
