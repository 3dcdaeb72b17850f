"""Every config.json field of every family's HF config class is read or refused by name.

The walker builds the family's transformers config class with one field at a time set to a
value other than its default (plus the `depends` values that make the field count), saves
it as config.json would hold it, and asks our registry: a field the family honours must
change the ModelConfig (or be refused with its name), an inert one must not matter, and
any other must be refused naming a field whose value changed. A field the family never
classified fails the test: adding a transformers field is a decision, not a silence."""

import inspect

import pytest
tf = pytest.importorskip("transformers", reason="walks the transformers config classes (the test extra)")

from hf_models import HF_SMALL
from jaxfill.models.config import ConfigError
from jaxfill.models.families import registry
from jaxfill.models.families.base import COMMON_INERT, COMMON_READ

CLASSES = {  # architecture -> transformers config class
    "LlamaForCausalLM": tf.LlamaConfig, "MistralForCausalLM": tf.MistralConfig, "Qwen2ForCausalLM": tf.Qwen2Config,
    "Qwen3ForCausalLM": tf.Qwen3Config, "Gemma2ForCausalLM": tf.Gemma2Config,
    "Gemma3ForCausalLM": tf.Gemma3TextConfig, "Phi3ForCausalLM": tf.Phi3Config, "Olmo2ForCausalLM": tf.Olmo2Config,
    "Olmo3ForCausalLM": tf.Olmo3Config, "GlmForCausalLM": tf.GlmConfig, "Glm4ForCausalLM": tf.Glm4Config,
    "SeedOssForCausalLM": tf.SeedOssConfig, "Exaone4ForCausalLM": tf.Exaone4Config,
    "MinistralForCausalLM": tf.MinistralConfig, "Ministral3ForCausalLM": tf.Ministral3Config,
    "ArceeForCausalLM": tf.ArceeConfig, "ApertusForCausalLM": tf.ApertusConfig,
    "SmolLM3ForCausalLM": tf.SmolLM3Config, "GraniteForCausalLM": tf.GraniteConfig,
    "MixtralForCausalLM": tf.MixtralConfig, "Qwen3MoeForCausalLM": tf.Qwen3MoeConfig,
    "Qwen2MoeForCausalLM": tf.Qwen2MoeConfig, "Glm4MoeForCausalLM": tf.Glm4MoeConfig,
    "GptOssForCausalLM": tf.GptOssConfig, "NemotronHForCausalLM": tf.NemotronHConfig,
    "OlmoeForCausalLM": tf.OlmoeConfig, "MiniMaxM2ForCausalLM": tf.MiniMaxM2Config,
    "Ernie4_5ForCausalLM": tf.Ernie4_5Config, "Ernie4_5_MoeForCausalLM": tf.Ernie4_5_MoeConfig,
    "HunYuanDenseV1ForCausalLM": tf.HunYuanDenseV1Config, "HunYuanMoEV1ForCausalLM": tf.HunYuanMoEV1Config,
    "PhimoeForCausalLM": tf.PhimoeConfig, "Lfm2ForCausalLM": tf.Lfm2Config, "Lfm2MoeForCausalLM": tf.Lfm2MoeConfig,
    "GraniteMoeHybridForCausalLM": tf.GraniteMoeHybridConfig,
    "Gemma4ForCausalLM": tf.Gemma4TextConfig,
    "AfmoeForCausalLM": tf.AfmoeConfig, "Mistral4ForCausalLM": tf.Mistral4Config,
    "FalconH1ForCausalLM": tf.FalconH1Config,
}
SKIP = {"self", "kwargs"}
# Values for fields whose default is None (the walker cannot guess a type).
NONE_VALUES = {"sliding_window": 16, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 5.0,
               "pad_token_id": 3, "bos_token_id": 4, "eos_token_id": 5, "head_dim": 48,
               "use_bidirectional_attention": True, "num_key_value_heads": 1, "rope_parameters": None,
               "layer_types": None, "no_rope_layers": None, "rope_scaling": None,
               "ssm_multipliers": [0.5, 1.0, 1.0, 1.0, 1.0], "mlp_multipliers": [0.5, 1.0]}


def small_kwargs(arch):
    name = {"Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
            "Phi3ForCausalLM": "phi3", "Olmo2ForCausalLM": "olmo2",
            "Olmo3ForCausalLM": "olmo3", "SmolLM3ForCausalLM": "smollm3",
            "GraniteForCausalLM": "granite"}.get(arch)
    kw = dict(HF_SMALL)
    if arch == "Glm4MoeForCausalLM":
        kw.update(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    elif arch == "GptOssForCausalLM":
        kw.update(num_local_experts=4, num_experts_per_tok=2)
    elif arch == "PhimoeForCausalLM":
        kw.update(num_local_experts=4, num_experts_per_tok=2)
    elif arch == "HunYuanMoEV1ForCausalLM":
        kw.update(num_experts=4, moe_topk=2)
    elif arch == "Ernie4_5_MoeForCausalLM":
        kw.update(moe_num_experts=4, moe_k=2, moe_intermediate_size=32)
    elif arch == "MiniMaxM2ForCausalLM":
        kw.update(num_local_experts=4, num_experts_per_tok=2, head_dim=16)
    elif arch == "OlmoeForCausalLM":
        kw.update(num_experts=4, num_experts_per_tok=2)
    elif arch == "AfmoeForCausalLM":
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    elif arch == "Mistral4ForCausalLM":
        kw.update(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1)
    elif "Moe" in arch or "Mixtral" in arch:
        kw.update(num_experts_per_tok=2, **({"num_local_experts": 4} if "Mixtral" in arch else
                                            {"num_experts": 4, "moe_intermediate_size": 32}))
    kw.pop("initializer_range")
    kw.update(num_hidden_layers=4)
    if arch.startswith("HunYuan"):  # transformers' Hunyuan needs head_dim set
        kw.update(head_dim=16)
    if arch == "NemotronHForCausalLM":  # dense blocks (its default pattern has an "E"), 4 SSM heads in 2 groups
        kw.update(layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"], mamba_num_heads=4,
                  mamba_head_dim=16, n_groups=2, ssm_state_size=16, head_dim=16)
    if arch == "Lfm2MoeForCausalLM":  # transformers builds no default layer_types for it
        kw.update(layer_types=["full_attention", "conv", "conv", "full_attention"])
    if arch == "GraniteMoeHybridForCausalLM":  # Mamba2 and attention, 8 SSM heads of 16 in 2 groups, 4 experts
        kw.pop("num_experts"), kw.pop("moe_intermediate_size")  # "Moe" in its name: not its spelling
        kw.update(layer_types=["linear_attention", "full_attention"] * 2, mamba_n_heads=8, mamba_n_groups=2,
                  mamba_d_state=16, num_local_experts=4, num_experts_per_tok=2)
    if arch == "FalconH1ForCausalLM":  # Mamba2 96 wide: 8 SSM heads of 12 in 2 groups, a 16-wide state
        kw.update(mamba_d_ssm=96, mamba_n_heads=8, mamba_d_head=12, mamba_n_groups=2, mamba_d_state=16)
    if arch == "Gemma4ForCausalLM":  # no per-layer inputs (their fields walk with `depends`), global layers 32 wide
        kw.update(head_dim=16, global_head_dim=32, hidden_size_per_layer_input=0)
    if name == "phi3":
        kw.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return kw


def other_value(name, value):
    if value is None:
        return NONE_VALUES.get(name, 7)
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value * 2 if value > 0 else 1
    if isinstance(value, float):
        return value * 1.5 if value else 0.25
    if isinstance(value, str):
        return "relu"
    if isinstance(value, list) and value:
        first = value[0]
        swap = {"full_attention": "sliding_attention", "sliding_attention": "full_attention", 0: 1, 1: 0,
                "linear_attention": "full_attention"}
        if isinstance(first, int) and not isinstance(first, bool) and first not in swap:  # token ids (GLM's eos)
            return [first + 1] + list(value[1:])
        return [swap.get(first, first)] + list(value[1:])
    return None  # dicts (rope_parameters): tests/test_family_fields.py::test_rope_types


def saved(cls, arch, **kw):
    d = cls(**kw).to_dict()
    d["architectures"] = [arch]
    return d


@pytest.mark.parametrize("arch", sorted(CLASSES))
def test_every_hf_field_is_read_or_refused(arch):
    cls, family = CLASSES[arch], registry.family_of(arch)
    base_kw = small_kwargs(arch)
    base = saved(cls, arch, **base_kw)
    registry.config_from_hf(base)
    fields = [n for n in inspect.signature(cls.__init__).parameters if n not in SKIP]
    unclassified = [n for n in fields if n not in family.honoured | family.inert | set(family.fixed)
                    | COMMON_READ | COMMON_INERT]
    assert not unclassified, f"{arch}: fields neither honoured, inert nor fixed: {unclassified}"
    checked = 0
    for name in fields:
        default = inspect.signature(cls.__init__).parameters[name].default
        deps = family.depends.get(name, {})  # what makes the field count, its own start value too
        reference_kw = {**base_kw, **deps}
        reference = saved(cls, arch, **reference_kw)
        value = other_value(name, reference_kw.get(name, reference.get(name, default)))  # derived lists too
        if value is None:
            continue
        try:
            hf = saved(cls, arch, **{**reference_kw, name: value})
        except Exception:  # transformers itself rejects the value
            continue
        ours = registry.config_from_hf(reference)
        changed = {k for k in hf if hf[k] != reference.get(k)}
        try:
            got = registry.config_from_hf(hf)
        except ConfigError as e:
            assert any(k in str(e) for k in changed) or name in str(e), (arch, name, str(e))
            checked += 1
            continue
        # a common field the family declares inert changes nothing (MLA's num_key_value_heads)
        if name in (family.honoured | COMMON_READ - {"rope_scaling", "rope_parameters"}) - family.inert:
            assert got != ours, f"{arch}: {name}={value!r} is said to be honoured but changes nothing"
        elif name in family.fixed:
            assert hf.get(name) == family.fixed[name] or hf.get(name) in (None, False), (arch, name)
        checked += 1
    assert checked >= len(fields) // 2


def test_unknown_architecture_names_every_supported_one():
    with pytest.raises(ConfigError) as e:
        registry.config_from_hf({"architectures": ["FalconForCausalLM"], "hidden_size": 8})
    for arch in registry.architectures():
        assert arch in str(e.value)


def test_granite_relabelled_as_llama_is_refused_by_name():
    hf = saved(tf.GraniteConfig, "LlamaForCausalLM", **small_kwargs("GraniteForCausalLM"), embedding_multiplier=12.0)
    with pytest.raises(ConfigError, match="embedding_multiplier"):
        registry.config_from_hf(hf)


def test_llama_with_tanh_gelu_is_honoured_and_unknown_activation_refused():
    base = small_kwargs("LlamaForCausalLM")
    assert registry.config_from_hf(saved(tf.LlamaConfig, "LlamaForCausalLM", **base,
                                  hidden_act="gelu_pytorch_tanh")).hidden_act == "gelu_tanh"
    with pytest.raises(ConfigError, match="hidden_act"):
        registry.config_from_hf(saved(tf.LlamaConfig, "LlamaForCausalLM", **base, hidden_act="relu"))


@pytest.mark.parametrize("rope,ok", [
    ({"rope_type": "linear", "factor": 2.0}, True),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}, True),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64}, True),
    ({"rope_type": "dynamic", "factor": 2.0}, False),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
      "original_max_position_embeddings": 256}, False),
])
def test_rope_types(rope, ok):
    kw = small_kwargs("Qwen3ForCausalLM")
    hf = saved(tf.Qwen3Config, "Qwen3ForCausalLM", **kw, rope_parameters={"rope_theta": 1e4, **rope})
    if ok:
        assert registry.config_from_hf(hf).attention.rope_scaling_dict["rope_type"] == rope["rope_type"]
    else:
        with pytest.raises(ConfigError, match=rope["rope_type"]):
            registry.config_from_hf(hf)


def test_phi3_partial_rotary_is_refused():
    kw = small_kwargs("Phi3ForCausalLM")
    hf = saved(tf.Phi3Config, "Phi3ForCausalLM", **kw, partial_rotary_factor=0.5)
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        registry.config_from_hf(hf)


def test_cli_lists_the_registry_and_refuses_an_unknown_architecture_in_one_line(tmp_path):
    import json
    import subprocess
    import sys

    listed = subprocess.run([sys.executable, "-m", "jaxfill.serving.cli", "models", "--json"],
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [r["architecture"] for r in rows] == list(registry.architectures())
    by_arch = {r["architecture"]: r for r in rows}
    assert "qwen3_8b" in by_arch["Qwen3ForCausalLM"]["presets"] and by_arch["Gemma2ForCausalLM"]["family"] == "gemma2"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"], "hidden_size": 8}))
    out = subprocess.run([sys.executable, "-m", "jaxfill.serving.cli", "generate", "--model", str(tmp_path),
                          "--prompt", "hi"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert "MambaForCausalLM" in line and all(arch in line for arch in registry.architectures())


def test_gemma3_transformers4_spelling_reads_as_the_transformers5_one():
    """Gemma 3 before transformers 5: rope_theta + rope_scaling for full layers,
    rope_local_base_freq for sliding ones, sliding_window_pattern instead of layer_types."""
    kw = dict(small_kwargs("Gemma3ForCausalLM"), num_hidden_layers=6)
    new = saved(tf.Gemma3TextConfig, "Gemma3ForCausalLM", **kw, sliding_window=24,
                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0},
               rope_local_base_freq=1e4, sliding_window_pattern=6)
    a, b = registry.config_from_hf(new), registry.config_from_hf(old)
    assert a == b
    assert a.attention.layer_types == ("sliding",) * 5 + ("full",) and a.attention.rope_local_theta == 1e4
    assert dict(a.attention.rope_scaling)["factor"] == 2.0


def test_minimax_m2_legacy_rotary_dim_reads_as_partial_rotary_factor():
    """The published MiniMax-M2 config.json says `rotary_dim` (transformers 4) where
    transformers 5 writes rope_parameters' partial_rotary_factor; a file with both must agree."""
    kw = small_kwargs("MiniMaxM2ForCausalLM")
    new = saved(tf.MiniMaxM2Config, "MiniMaxM2ForCausalLM", **kw,
                rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old.update(rope_theta=1e4, rotary_dim=8)
    assert registry.config_from_hf(new) == registry.config_from_hf(old)
    assert registry.config_from_hf(old).attention.rotary_dim == 8
    with pytest.raises(ConfigError, match="rotary_dim"):
        registry.config_from_hf({**new, "rotary_dim": 4})
