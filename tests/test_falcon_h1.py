"""Falcon-H1 (attention and Mamba2 in parallel in every layer, then the MLP) against Hugging
Face transformers on random-init checkpoints (tests/hf_models.py HYBRID_KWARGS: every muP
multiplier off 1 and apart from the others, Mamba's gated norm before the gate, a
projectors bias), at the model level (engine/simple.py): f32 last-row logits within 1e-5
relative and greedy tokens equal to HF's generate; two variants (the norm after the gate
with attention biases and a time-step limit that binds; no Mamba norm with tied
embeddings and the Mamba width from mamba_expand); each new multiplier moves the logits; a
fresh sequence ignores its slot (chunked = whole: tests/test_falcon_h1_engine.py); what is
not reproduced is refused by name; the planner counts every layer's attention. Unused
pages and slots are NaN-filled."""

import json
import os

import numpy as np
import pytest
from flax import nnx

from hf_models import load_hf, make_hf_checkpoint
from jaxfill.models.checkpoint import load_hf_params
from jaxfill.models.config import ConfigError
from jaxfill.models.families import registry
from jaxfill.models.families.registry import config_from_hf, new_model, param_count
from jaxfill.models.linear_state import PagesAndState, cache_states
from test_hybrid_parity import fresh_cache, prefill_chunks
from test_model_parity import check_greedy_matches_hf, hf_last_logits, ours_last_logits, prompts, rel_l2

ARCH = "falcon_h1"


@pytest.fixture(scope="module")
def falcon(tmp_path_factory):
    directory = make_hf_checkpoint(str(tmp_path_factory.mktemp("falcon") / ARCH), ARCH)
    config = config_from_hf(directory)
    return directory, config, load_hf_params(directory, config, progress=False)


def check_logits(directory, config, model, hf=None) -> None:
    hf = hf or load_hf(directory)
    assert param_count(config) == sum(p.numel() for p in hf.parameters())
    for length, tokens in prompts(config.vocab_size):
        err = rel_l2(ours_last_logits(model, config, tokens), hf_last_logits(hf, tokens))
        assert err <= 1e-5, (length, err)


def test_f32_logits_and_greedy_tokens_match_hf(falcon):
    directory, config, model = falcon
    lin, a = config.linear, config.attention
    assert lin.layers == (0, 1, 2) and lin.parallel and lin.kind == "mamba2" and config.kv_layers == 3
    assert (lin.in_scale, lin.out_scale, lin.part_scales, lin.gated_norm, lin.out_bias) == (
        1.2, 0.8, (0.7, 1.3, 0.8, 1.2, 0.9), "before_gate", True)
    assert (a.key_scale, a.in_scale, a.out_scale, config.mlp_scales) == (0.6, 1.3, 0.7, (1.4, 0.6))
    assert (config.embeddings.scale, config.embeddings.logits_scale, lin.value_head_dim) == (2.0, 0.5, 12)
    hf = load_hf(directory)
    check_logits(directory, config, model, hf)
    check_greedy_matches_hf(model, config, hf, 12)


VARIANTS = {
    # the gate before the norm (Nemotron-H's order), q/k/v/o biases, no out_proj bias; a
    # time-step limit that binds (dt_bias ~ 1: softplus > 0.5) on the prefill HF runs
    "norm_after_gate": dict(mamba_norm_before_gate=False, attention_bias=True, projectors_bias=False,
                            time_step_limit=[0.0, 0.5]),
    # no gated norm (transformers' nn.Identity), tied embeddings, the width mamba_expand x hidden
    "no_norm_tied": dict(mamba_rms_norm=False, tie_word_embeddings=True, mamba_d_ssm=None, mamba_d_head="auto"),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_match_hf(tmp_path, variant):
    directory = make_hf_checkpoint(str(tmp_path / variant), ARCH, **VARIANTS[variant])
    config = config_from_hf(directory)
    if variant == "norm_after_gate":
        assert (config.linear.gated_norm, config.attention.bias, config.linear.out_bias) == ("after_gate", True, False)
        assert config.linear.dt_limit == (0.0, 0.5)
    else:
        assert (config.linear.gated_norm, config.embeddings.tied, config.linear.value_head_dim) == ("none", True, 16)
    check_logits(directory, config, load_hf_params(directory, config, progress=False))


@pytest.mark.slow  # 40 s in a full run (2026-12-07, 2 loaded cores)
def test_each_multiplier_changes_the_logits(falcon):
    """The multipliers that act inside a block (K's, the muP vector's dt part, the MLP
    gate's) at 1, the others kept, move the 300-token prompt's last logits by more than
    1e-3 relative: none is silently inert in the parity above. (The in / out multipliers
    scale whole branches; three compiles keep the file inside its time.)"""
    directory, config, loaded = falcon
    tokens = prompts(config.vocab_size)[-1][1]
    base = ours_last_logits(loaded, config, tokens)
    weights = dict(nnx.to_flat_state(nnx.state(loaded)))
    for ablation in (dict(key_scale=1.0), dict(mlp_scales=(1.0, 0.6)),
                     dict(linear_part_scales=(0.7, 1.3, 0.8, 1.2, 1.0))):
        changed = config.replace(**ablation)
        other = new_model(changed, nnx.Rngs(0))
        for path, var in nnx.to_flat_state(nnx.state(other)):
            var.set_value(weights[path][...])
        assert rel_l2(ours_last_logits(other, changed, tokens), base) > 1e-3, ablation


@pytest.mark.slow  # 40 s in a full run (2026-12-07, 2 loaded cores)
def test_a_fresh_sequence_ignores_what_its_slot_holds(falcon):
    """A fresh prompt in the slot another prompt filled (and on pages beside its pages)
    == in a clean cache, bit for bit; every layer's entry holds pages and a state."""
    _, config, model = falcon
    rng = np.random.default_rng(6)
    a, b = ([int(t) for t in rng.integers(0, config.vocab_size, n)] for n in (40, 25))
    _, used = prefill_chunks(model, a, fresh_cache(config, slots=1), [1, 2, 3])
    assert all(isinstance(e, PagesAndState) for e in used.pages)
    assert all(np.isfinite(np.asarray(s.recurrent)).all() for s in cache_states(used.pages))
    reused, _ = prefill_chunks(model, b, used, [4, 5])
    clean, _ = prefill_chunks(model, b, fresh_cache(config, slots=1), [4, 5])
    np.testing.assert_array_equal(np.asarray(reused), np.asarray(clean))


def test_slot_copies_carry_the_parallel_layers_states(falcon):
    """copy_state_slots (snapshots taken, then restored) copies each PagesAndState layer's
    recurrent state and conv history, and leaves its pages as they were."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from jaxfill.models.kv_cache import KVCache
    from jaxfill.models.linear_state import LinearState, copy_state_slots

    cache = KVCache.create(falcon[1], num_pages=4, page_size=16, state_slots=3)
    keys = iter(jax.random.split(jax.random.key(3), 3 * len(cache.pages)))
    draw = lambda a: jax.random.normal(next(keys), a.shape, jnp.float32).astype(a.dtype)  # noqa: E731
    cache = dataclasses.replace(cache, pages=tuple(
        PagesAndState(draw(e.pages), LinearState(draw(e.state.recurrent), draw(e.state.conv))) for e in cache.pages))
    before = [(np.asarray(e.pages), np.asarray(e.state.recurrent), np.asarray(e.state.conv)) for e in cache.pages]
    one = lambda v: jnp.asarray([v], jnp.int32)  # noqa: E731
    after = copy_state_slots(cache, one(0), one(1), one(1), one(2))  # 0 -> 1, then 1 -> 2 (the cache donated)
    for (pages, recurrent, conv), entry in zip(before, after.pages):
        for want, got in ((recurrent, entry.state.recurrent), (conv, entry.state.conv)):
            got = np.asarray(got)
            assert not np.array_equal(want[2], want[0])
            np.testing.assert_array_equal(got[1], want[0])
            np.testing.assert_array_equal(got[2], want[0])
        np.testing.assert_array_equal(np.asarray(entry.pages), pages)


def test_what_it_cannot_reproduce_is_refused_by_name(falcon):
    from jaxfill.engine.config import load_config

    with open(os.path.join(falcon[0], "config.json")) as f:
        hf = json.load(f)
    for change, name in [({"mamba_proj_bias": True}, "mamba_proj_bias"), ({"mlp_bias": True}, "mlp_bias"),
                         ({"hidden_act": "gelu"}, "hidden_act"), ({"mamba_d_head": 16}, "mamba_d_head"),
                         ({"ssm_multipliers": [1.0] * 4}, "ssm_multipliers")]:
        with pytest.raises(ConfigError, match=name):
            config_from_hf({**hf, **change})
    # engine.scan_layers runs it (one layer a step: tests/test_hybrid_scan.py)
    with pytest.raises(ConfigError, match="mesh.sequence = .* is refused"):
        load_config("tiny", {"mesh.sequence": 2}, falcon[0])
    assert "FalconH1ForCausalLM" in registry.architectures() and "FalconH1ForCausalLM" not in registry.REFUSED


def test_the_planner_counts_each_layers_attention(falcon):
    """Every layer attends beside its Mamba2: the plan's attention FLOPs and KV bytes are
    those of the same layers without Mamba2 (the state counted apart)."""
    from jaxfill.engine.planner.counts import attention_flops, state_bytes

    config = falcon[1]
    plain = config.replace(linear_layers=())
    assert config.kv_layers == plain.kv_layers == config.num_layers
    assert attention_flops(config, 64) == attention_flops(plain, 64) > 0
    assert state_bytes(config) > 0 == state_bytes(plain)
