"""The nested model config (models/config/) and the one mixer protocol (models/mixers/):
flat keys in and out lose nothing, each section refuses its own bad values by the key a
user writes, every mixer takes (x, cache_entry, ctx), and the Decoder runs what its
execution plan says."""

import dataclasses
import inspect

import pytest

from jaxfill.engine.config import load_config
from jaxfill.engine.presets import preset_names
from jaxfill.models.config import FLAT_KEYS, ConfigError, ModelConfig, flat_keys
from jaxfill.models.config.model import SECTIONS
from jaxfill.models.mixers import MIXERS, mixer_kind


def test_flat_keys_name_every_section_field_once():
    targets = list(FLAT_KEYS.values())
    assert len(targets) == len(set(targets))
    every = {(s, f.name) for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    assert set(targets) == every
    top = {f.name for f in dataclasses.fields(ModelConfig)} - set(SECTIONS)
    assert not top & set(FLAT_KEYS), "a flat key must name one field only"


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_round_trips_through_flat_keys(name):
    model = load_config(name).model
    flat = model.flat()
    assert set(flat) == flat_keys()
    assert ModelConfig.from_dict(flat) == model
    assert model.replace() == model


def test_replace_and_value_route_flat_keys_into_sections():
    base = ModelConfig.of(num_experts=8, experts_per_token=2, moe_intermediate_size=16, router_scoring="sigmoid",
                          router_groups=2, rms_norm_eps=1e-6, linear_layers=[1], linear_num_key_heads=2,
                          linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
    assert (base.moe.num_experts, base.moe.scoring, base.moe.groups) == (8, "sigmoid", 2)
    assert base.norms.eps == 1e-6 and base.linear.layers == (1,) and base.linear.value_head_dim == 8
    changed = base.replace(router_groups=4, embed_scale=2.0)
    assert changed.moe.groups == 4 and changed.embeddings.scale == 2.0 and changed.moe.num_experts == 8
    assert changed.value("router_groups") == 4 and changed.value("hidden_size") == base.hidden_size
    with pytest.raises(KeyError):
        base.value("moe")


@pytest.mark.parametrize("flat, says", [
    ({"router_scoring": "argmax"}, "model.router_scoring must be one of"),
    ({"norm_kind": "batch"}, "model.norm_kind must be one of"),
    ({"norm_kind": "layer", "qk_norm": "head"}, "model.norm_kind = layer"),
    ({"qk_norm_after_rope": True}, "model.qk_norm_after_rope needs a qk_norm"),
    ({"qkv_clip": 0.0}, "model.qkv_clip must be positive"),
    ({"num_experts": 4, "experts_per_token": 3, "moe_intermediate_size": 8, "router_scoring": "sparsemixer",
      "router_renormalize": False}, "sparsemixer picks two experts"),
    ({"router_scoring": "topk_softmax", "router_bias": True}, "model.router_bias"),
    ({"linear_kind": "rwkv"}, "model.linear_kind must be one of"),
    ({"mla_form": "both"}, "model.mla_form must be one of"),
    ({"qk_norm": "layer"}, "model.qk_norm must be one of"),
    ({"num_experts": 4, "experts_per_token": 5, "moe_intermediate_size": 8}, "model.experts_per_token"),
    ({"sliding_window": -5}, "model.sliding_window must be positive"),
    ({"linear_layers": [9]}, "model.linear_layers"),
    ({"layer_types": ["full"] * 3}, "one type per layer"),
    ({"no_such_key": 1}, "unknown [model] keys"),
])
def test_bad_values_are_refused_by_the_key_users_write(flat, says):
    with pytest.raises(ConfigError, match=None) as e:
        ModelConfig.of(**flat)
    assert says in str(e.value)


def test_an_override_names_flat_keys():
    cfg = load_config("tiny_random", {"model.rms_norm_eps": 1e-3, "model.attention_bias": True})
    assert cfg.model.norms.eps == 1e-3 and cfg.model.attention.bias
    with pytest.raises(ConfigError, match="unknown key 'model.norms'"):
        load_config("tiny_random", {"model.norms": 1})


def test_every_mixer_takes_x_its_cache_entry_and_the_context():
    for kind, cls in MIXERS.items():
        params = list(inspect.signature(cls.__call__).parameters)
        assert len(params) == 4 and params[0] == "self" and params[1] == "x" and params[3] == "ctx", (kind, params)


@pytest.mark.parametrize("name, kinds", [
    ("tiny_random", {"attention"}), ("qwen3_5_9b", {"attention", "gated_deltanet"}),
    ("nemotron_h_8b", {"attention", "mamba2", None}), ("deepseek_v3", {"mla"}),
])
def test_mixer_kinds_follow_the_config(name, kinds):
    m = load_config(name).model
    assert {mixer_kind(m, n) for n in range(m.num_layers)} == kinds


def test_the_decoder_refuses_a_pruning_plan_on_split_rows(monkeypatch):
    """The plan decides; a plan that prunes while the mesh splits the rows is an error,
    not a silent switch to the other rule."""
    import jax.numpy as jnp

    from jaxfill.models import decoder
    from jaxfill.models.execution_plan import ExecutionPlan
    from jaxfill.models.kv_cache import KVCache, single_sequence_metadata

    config = load_config("tiny_random").model.replace(num_layers=1)
    model = decoder.Decoder(config)
    cache = KVCache.create(config, num_pages=4, page_size=16)
    meta = single_sequence_metadata(8, 0, [1], 16)
    tokens = jnp.arange(1, 9, dtype=jnp.int32)
    monkeypatch.setattr(decoder, "rows_split_over_sequence", lambda: True)
    with pytest.raises(ValueError, match="splits the rows over 'sequence'"):
        model(tokens, jnp.arange(8, dtype=jnp.int32), cache, meta)
    model.plan = ExecutionPlan(prunes_last_layer=False)
    logits, _ = model(tokens, jnp.arange(8, dtype=jnp.int32), cache, meta)
    assert logits.shape == (1, config.vocab_size) and bool(jnp.isfinite(logits).all())
