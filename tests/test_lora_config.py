"""The [lora] section: values checked alone, combinations refused by the capability table
(engine/capabilities/table.py) and families by engine/lora/settings.py, each in one line
naming the key; without it the step's inputs are what they were (no tables, no slot ids)."""

import pytest
from flax import nnx

from jaxfill.engine.batch import dummy_batch
from jaxfill.engine.config import load_config
from jaxfill.models.config import ConfigError
from jaxfill.models.lora import attach_tables, table_leaves

ON = {"lora.max_loras": 2}


@pytest.mark.parametrize("overrides, match", [
    ({"lora.max_loras": -1}, "lora.max_loras must be an integer >= 0"),
    ({"lora.max_loras": 2, "lora.max_lora_rank": 0}, "lora.max_lora_rank must be an integer >= 1"),
    ({"lora.max_loras": 4, "lora.max_cpu_loras": 2}, r"lora.max_cpu_loras \(2\) must be >= lora.max_loras"),
    ({"lora.max_loras": True}, "lora.max_loras must be an integer"),
    ({"lora.rank": 8}, "unknown key 'lora.rank'"),
])
def test_bad_values_are_refused_by_name(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config("tiny_random", overrides)


@pytest.mark.parametrize("overrides, match", [
    ({"mesh.data": 2}, "lora.max_loras = 2 with mesh.data = 2 is refused"),
    ({"mesh.stage": 2}, "with mesh.stage = 2 is refused"),
    ({"engine.scan_layers": True}, "with engine.scan_layers = True is refused"),
    ({"model.weight_dtype": "int8"}, "with model.weight_dtype = 'int8' is refused"),
    ({"speculative.method": "ngram"}, "with speculative.method = 'ngram' is refused"),
])
def test_layouts_lora_does_not_cover_are_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config("tiny_random", {**ON, **overrides})


@pytest.mark.parametrize("preset, match", [
    ("deepseek_v2_lite", "with mla layers is refused"),
    ("mixtral_8x7b", "MixtralForCausalLM: lora.max_loras = 2 is refused"),
    ("qwen3_5_9b", "with gated_deltanet layers"),
    ("mistral_7b", "MistralForCausalLM: lora.max_loras = 2 is refused"),
])
def test_models_lora_does_not_cover_are_refused(preset, match):
    with pytest.raises(ConfigError, match=match):
        load_config(preset, ON)


@pytest.mark.parametrize("overrides, match", [
    ({"mesh.tensor": 2}, "with moe layers with mesh.tensor = 2 is refused"),
    ({"mesh.expert": 2}, "with mesh.expert = 2 is refused"),
])
def test_expert_layouts_lora_does_not_cover_are_refused(overrides, match):
    load_config("qwen3_30b_a3b", ON)  # Qwen3-MoE takes LoRA (tests/test_lora_moe.py)
    with pytest.raises(ConfigError, match=match):
        load_config("qwen3_30b_a3b", {**ON, **overrides})


def test_without_lora_the_step_inputs_are_unchanged():
    """lora.max_loras = 0: no LoRA params in the model's state and no slot ids in the
    batch, so the step's pytree (and program) is the base model's; with it, both appear."""
    from jaxfill.engine.loading import build_model

    config = load_config("tiny_random", {"model.num_layers": 1})
    model = build_model(config, None, progress=False)
    assert table_leaves(nnx.split(model)[1]) == {}
    assert dummy_batch((16, 4), 4, 8, 320).meta.lora_slots is None
    tables = table_leaves(nnx.split(attach_tables(model, 2, 4))[1])
    assert sorted(p for _, p in tables) == ["down", "gate", "k", "o", "q", "up", "v"]
    assert tables[(0, "o")][0].shape == (2, 4, 32, 4) and tables[(0, "q")][1].shape == (2, 4, 4, 32)
    assert table_leaves(nnx.split(model)[1]) == {}  # the caller's model is left as it was
    assert dummy_batch((16, 4), 4, 8, 320, lora=True).meta.lora_slots.shape == (16,)
