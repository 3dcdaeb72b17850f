"""Presets load, overrides apply, and bad configs fail with a message naming the problem."""

import json

import pytest

from jaxfill.engine.config import load_config, parse_overrides
from jaxfill.models.config import ConfigError
from jaxfill.models.families.registry import config_from_hf, param_count

PRESETS = ["tiny", "tiny_random", "bench", "llama2_7b", "llama3_8b", "llama3_70b", "llama3_1_8b", "mistral_7b", "qwen2_7b",
           "deepseek_v3", "kimi_k2", "deepseek_v2_lite", "qwen3_5_9b", "qwen3_next_80b_a3b", "nemotron_h_8b",
           "qwen3_5_397b_a17b", "minimax_m2", "deepseek_v32", "glm5", "kimi_linear_48b_a3b",
           "gemma4_31b", "llama4_maverick"]
PUBLISHED_PARAMS = {"llama2_7b": 6.74e9, "llama3_8b": 8.03e9, "llama3_70b": 70.55e9, "mistral_7b": 7.24e9,
                    "qwen2_7b": 7.62e9, "qwen3_5_9b": 8.95e9,  # Qwen3.5-9B: its text model (GGUF metadata)
                    "qwen3_5_397b_a17b": 397e9,
                    # Kimi-Linear-48B-A3B: the Hub's safetensors count as recalled (49.1B, not confirmed
                    # offline; "48B" in the name rounds it)
                    "kimi_linear_48b_a3b": 49.1e9,
                    "glm5": 744e9,
                    "gemma4_31b": 30.7e9, "llama4_maverick": 400e9}  # the GLM-5 technical report's total (its MTP layer apart)


@pytest.mark.parametrize("name", PRESETS)
def test_presets_load(name):
    config = load_config(name)
    assert config.name == name
    if name in PUBLISHED_PARAMS:
        assert abs(param_count(config.model) - PUBLISHED_PARAMS[name]) / PUBLISHED_PARAMS[name] < 0.005


def test_nemotron_h_8b_counts_its_published_shape_by_hand():
    """Nemotron-H-8B ("8B"): embeddings and head, 24 Mamba2 layers (in_proj to z, x B C and
    dt; conv weight and bias; dt_bias, A_log, D; the gated norm; out_proj), 24 MLP layers
    (up, down), 4 attention layers, a norm per layer and the final one."""
    e, v, i, h, p, g, n, k, d = 4096, 131072, 21504, 128, 64, 8, 128, 4, 128
    conv = h * p + 2 * g * n
    mamba = e * (h * p + conv + h) + conv * k + conv + 3 * h + h * p + h * p * e + e
    mlp = 2 * e * i + e
    attention = e * 32 * d + 2 * e * 8 * d + 32 * d * e + e
    want = 2 * v * e + 24 * mamba + 24 * mlp + 4 * attention + e
    assert want == 8_100_852_736
    assert param_count(load_config("nemotron_h_8b").model) == want


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
    old = config_from_hf({**base, "rope_theta": 500000.0, "rope_scaling": scaling, "torch_dtype": "bfloat16"})
    new = config_from_hf({**base, "rope_parameters": {"rope_theta": 500000.0, **scaling}, "dtype": "bfloat16"})
    assert old == new
    assert old.attention.rope_theta == 500000.0 and dict(old.attention.rope_scaling)["factor"] == 8.0 and old.dtype == "bfloat16"


def test_from_hf_rejects_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="GPT2LMHeadModel.*not supported"):
        config_from_hf(tmp_path)


def test_parse_overrides_types():
    assert parse_overrides(["engine.enable_prefix_caching=false", "model.rope_theta=1e6"]) == {
        "engine": {"enable_prefix_caching": False}, "model": {"rope_theta": 1e6}}


HF_BASE = dict(architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _hf_dir(tmp_path, **extra):
    (tmp_path / "config.json").write_text(json.dumps({**HF_BASE, **extra}))
    return str(tmp_path)


@pytest.mark.parametrize("preset", ["tiny_random", "llama3_8b"])
def test_preset_max_model_len_shrinks_to_the_checkpoint(tmp_path, caplog, preset):
    """A preset's engine settings are defaults: a checkpoint with a shorter context loads."""
    model_dir = _hf_dir(tmp_path, max_position_embeddings=1024)
    assert load_config(preset).engine.max_model_len > 1024
    with caplog.at_level("WARNING", logger="jaxfill.config"):
        config = load_config(preset, model_path=model_dir)
    assert config.engine.max_model_len == 1024
    assert [r.getMessage() for r in caplog.records if "max_model_len" in r.getMessage()] == [
        f"engine.max_model_len {load_config(preset).engine.max_model_len} -> 1024: the model's "
        "max_position_embeddings (set --set engine.max_model_len=N to choose)"]
    assert load_config(preset, {"engine.max_model_len": 512}, model_dir).engine.max_model_len == 512


def test_explicit_max_model_len_above_the_checkpoint_is_an_error(tmp_path):
    model_dir = _hf_dir(tmp_path, max_position_embeddings=1024)
    with pytest.raises(ConfigError, match=r"engine.max_model_len \(2048\) exceeds .*\(1024\)"):
        load_config("tiny_random", ["engine.max_model_len=2048"], model_dir)


@pytest.mark.parametrize("make,match", [
    (lambda p: str(p / "missing"), "does not exist"),
    (lambda p: str(p), "has no config.json"),
    (lambda p: (p / "config.json").write_text("{not json") and str(p), "cannot read"),
    (lambda p: (p / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}') and str(p), "lacks vocab_size"),
])
def test_bad_model_directories_are_config_errors(tmp_path, make, match):
    with pytest.raises(ConfigError, match=match):
        load_config("tiny_random", model_path=make(tmp_path))


def test_hardware_table_is_not_a_preset():
    from jaxfill.engine.config import preset_names

    assert "hardware" not in preset_names() and {"tiny", "tiny_random", "llama3_8b"} <= set(preset_names())
    with pytest.raises(ConfigError, match="neither a file nor a preset"):
        load_config("hardware")


def test_presets_are_read_from_the_installed_package():
    """Presets resolve through importlib.resources, not the current directory."""
    import importlib.resources
    import os

    package = importlib.resources.files("jaxfill.configs")
    assert {f.name for f in package.iterdir()} >= {"tiny.toml", "tiny_random.toml"}
    cwd = os.getcwd()
    try:
        os.chdir("/")
        assert load_config("tiny_random").name == "tiny_random"
    finally:
        os.chdir(cwd)


def test_a_bool_setting_refuses_anything_but_true_or_false():
    # Python's spelling "False" is not TOML: it used to stay the string "False", i.e. true.
    with pytest.raises(ConfigError, match="enable_prefix_caching must be true or false"):
        load_config("tiny_random", ["engine.enable_prefix_caching=False"])
    assert load_config("tiny_random", ["engine.enable_prefix_caching=false"]).engine.enable_prefix_caching is False
