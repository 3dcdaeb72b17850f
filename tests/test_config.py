"""Presets load, overrides apply, and bad configs fail with a message naming the problem."""

import json

import pytest

from jaxfill.engine.config import load_config, parse_overrides
from jaxfill.models.config import ConfigError, ModelConfig

PRESETS = ["tiny", "tiny_random", "bench", "llama2_7b", "llama3_8b", "llama3_70b", "llama3_1_8b", "mistral_7b", "qwen2_7b"]
PUBLISHED_PARAMS = {"llama2_7b": 6.74e9, "llama3_8b": 8.03e9, "llama3_70b": 70.55e9, "mistral_7b": 7.24e9,
                    "qwen2_7b": 7.62e9}


@pytest.mark.parametrize("name", PRESETS)
def test_presets_load(name):
    config = load_config(name)
    assert config.name == name
    if name in PUBLISHED_PARAMS:
        assert abs(config.model.num_params() - PUBLISHED_PARAMS[name]) / PUBLISHED_PARAMS[name] < 0.005


def test_tiny_is_a_gqa_byte_model_with_page_size_16():
    c = load_config("configs/tiny.toml")
    assert c.model.tokenizer == "byte" and c.model.num_kv_heads < c.model.num_heads
    assert c.engine.page_size == 16


def test_overrides_from_dict_and_cli_strings_agree():
    a = load_config("tiny", {"mesh.tensor": 4, "engine.page_size": 8, "model.dtype": "bfloat16"})
    b = load_config("tiny", ["mesh.tensor=4", "engine.page_size=8", "model.dtype=bfloat16"])
    assert a == b and a.mesh.tensor == 4 and a.engine.page_size == 8 and a.model.dtype == "bfloat16"
    assert load_config("tiny", ["engine.attention_impl=reference"]).engine.attention_impl == "reference"


@pytest.mark.parametrize("overrides,match", [
    (["mesh.tensr=4"], "unknown key 'mesh.tensr'"),
    (["foo.bar=1"], "model.*, engine.*, mesh.*"),
    (["engine.page_size"], "section.key=value"),
    (["engine.page_size=0"], "engine.page_size must be positive"),
    (["model.num_kv_heads=3"], "multiple of"),
    (["model.dtype=float8"], "model.dtype"),
    (["engine.max_model_len=999999"], "max_position_embeddings"),
    (["engine.scheduling_policy=lifo"], "fcfs or priority"),
])
def test_bad_overrides(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config("tiny", overrides)


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError, match="presets: .*tiny"):
        load_config("no_such_model")


def test_from_hf_reads_both_rope_spellings():
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    old = ModelConfig.from_hf({**base, "rope_theta": 500000.0, "rope_scaling": scaling, "torch_dtype": "bfloat16"})
    new = ModelConfig.from_hf({**base, "rope_parameters": {"rope_theta": 500000.0, **scaling}, "dtype": "bfloat16"})
    assert old == new
    assert old.rope_theta == 500000.0 and dict(old.rope_scaling)["factor"] == 8.0 and old.dtype == "bfloat16"


def test_from_hf_rejects_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="GPT2LMHeadModel.*not supported"):
        ModelConfig.from_hf(tmp_path)


def test_parse_overrides_types():
    assert parse_overrides(["engine.enable_prefix_caching=false", "model.rope_theta=1e6"]) == {
        "engine": {"enable_prefix_caching": False}, "model": {"rope_theta": 1e6}}
