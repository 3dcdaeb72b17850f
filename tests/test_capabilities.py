"""The capability table (engine/capabilities/table.py) is the one place combinations are decided:

- no `raise ConfigError` outside engine/validation.py names two config keys (a
  combination refused elsewhere);
- every rule refuses at load_config, before any weight is read, with one line naming the
  combination and the key to change; the combinations that used to be refused late or
  downgraded silently are among them;
- every test the evidence names exists and sets the capability it is named for, and no
  refused cell claims a test;
- README's matrix and docs/capabilities.md are what the table generates now.
Needs no torch (the per-family cells with real checkpoints: tests/test_capability_cells.py).
"""

from __future__ import annotations

import ast
import os
import re

import pytest

from jaxfill.engine.capabilities import support_matrix
from jaxfill.engine.capabilities.table import CAPABILITIES, RULES, family_kinds
from jaxfill.engine.capabilities.evidence import EVIDENCE
from jaxfill.engine.config import load_config
from jaxfill.engine.validation import validate
from jaxfill.models.config import ConfigError
from jaxfill.models.families import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY = ("engine", "models", "serving", "pallas_kernels")
KEY = re.compile(r"\b(?:engine|mesh|model)\.[a-z_]+")


def _config_error_messages():
    """(file, line, message source) of every `raise ConfigError(...)` in the library."""
    for folder in LIBRARY:
        for dirpath, _, names in os.walk(os.path.join(ROOT, folder)):
            for name in names:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                tree = ast.parse(open(path).read())
                for node in ast.walk(tree):
                    if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                            and getattr(node.exc.func, "id", None) == "ConfigError"):
                        yield os.path.relpath(path, ROOT), node.lineno, ast.unparse(node.exc)


def test_no_combination_is_refused_outside_the_validation_module():
    found = list(_config_error_messages())
    assert len(found) > 30  # the scan sees the library's refusals
    # two keys, one of them an engine or mesh setting (model.* alone: a checkpoint's own consistency)
    combos = [(f, line, msg) for f, line, msg in found if f != os.path.join("engine", "validation.py")
              and len(set(KEY.findall(msg))) >= 2 and any(not k.startswith("model.") for k in KEY.findall(msg))]
    assert not combos, combos


TINY = {"engine.num_pages": 16, "engine.max_model_len": 128, "engine.max_num_batched_tokens": 32}
HYBRID = {"model.linear_layers": [0, 1, 2], "model.linear_num_key_heads": 2, "model.linear_num_value_heads": 4,
          "model.linear_key_head_dim": 16, "model.linear_value_head_dim": 16}
MLA = {"model.architecture": "DeepseekV3ForCausalLM", "model.kv_lora_rank": 32, "model.qk_rope_head_dim": 16,
       "model.qk_nope_head_dim": 16, "model.v_head_dim": 16, "model.num_kv_heads": 1, "model.head_dim": 48,
       "model.rotary_dim": 16}
DSA = {**MLA, "model.q_lora_rank": 16, "model.index_topk": 8, "model.index_n_heads": 2, "model.index_head_dim": 16,
       "model.head_dim": 64}
# the MTP proposer on a random-init model that declares its layer (a checkpoint's num_nextn_predict_layers)
MTP = {"model.mtp_layers": 1, "speculative.method": "mtp", "speculative.num_tokens": 1}
# Gemma 4's shape: full layers with their own head dim beside sliding ones
MIXED_KV = {"model.sliding_window": 8, "model.layer_types": ["sliding", "full"] * 2, "model.global_head_dim": 64}
LONGCAT = {**MLA, "model.architecture": "LongcatFlashForCausalLM", "model.q_lora_rank": 16, "model.num_experts": 4,
           "model.zero_experts": 2, "model.experts_per_token": 2, "model.moe_intermediate_size": 32,
           "model.moe_shortcut": True, "model.router_bias": True}
# Qwen3-VL's text tower: (t, h, w) rope sections over the 16 frequencies of a 32-wide head
MROPE = {"model.architecture": "Qwen3VLForConditionalGeneration", "model.mrope_section": [8, 4, 4]}
# one config (tiny_random overrides, extra flags) that breaks each rule and no earlier one
BREAKS = {
    ("mixed_kv", "engine.scan_layers"): ({**MIXED_KV, "engine.scan_layers": True}, ()),
    ("mixed_kv", "mesh.stage"): ({**MIXED_KV, "mesh.stage": 2}, ()),
    ("mixed_kv", "engine.host_kv_cache_gb"): ({**MIXED_KV, "engine.host_kv_cache_gb": 1}, ()),
    ("mixed_kv", "serve.role=prefill/decode"): (MIXED_KV, ("serve.role=prefill/decode",)),
    ("linear", "mesh.sequence"): ({**HYBRID, "mesh.sequence": 2}, ()),
    ("linear", "mesh.data", "serve.role=prefill/decode"): ({**HYBRID, "mesh.data": 2}, ("serve.role=prefill/decode",)),
    ("linear", "mesh.num_processes"): ({**HYBRID, "mesh.num_processes": 2, "mesh.coordinator": "127.0.0.1:1"}, ()),
    **{(kind, "engine.disk_kv_cache_dir"): ({**HYBRID, "model.linear_kind": kind, **heads, "engine.host_kv_cache_gb": 1,
                                             "engine.disk_kv_cache_gb": 1, "engine.disk_kv_cache_dir": "/tmp/x"}, ())
       for kind, heads in (("short_conv", {}), ("kda", {"model.linear_num_key_heads": 4}))},
    ("moe", "model.weight_dtype=int_group", "model.weight_act_order=true"): (
        {"model.architecture": "MixtralForCausalLM", "model.num_experts": 4, "model.experts_per_token": 2,
         "model.weight_dtype": "int_group", "model.weight_act_order": True}, ()),
    ("mla", "model.weight_dtype=int_group", "!model.weight_int_scope=experts"): (
        {**MLA, "model.weight_dtype": "int_group"}, ()),
    ("!moe", "model.weight_dtype=int_group", "model.weight_int_scope=experts"): (
        {"model.weight_dtype": "int_group", "model.weight_int_scope": "experts"}, ()),
    ("linear", "model.weight_dtype=int_group"): ({**HYBRID, "model.weight_dtype": "int_group"}, ()),
    ("mesh.expert", "!moe"): ({"mesh.expert": 2}, ()),
    ("dsa", "mesh.sequence"): ({**DSA, "mesh.sequence": 2}, ()),
    ("shortcut", "mesh.stage"): ({**LONGCAT, "mesh.stage": 2}, ()),
    ("shortcut", "engine.scan_layers"): ({**LONGCAT, "engine.scan_layers": True}, ()),
    ("mesh.stage", "mesh.sequence"): ({"mesh.stage": 2, "mesh.sequence": 2}, ()),
    ("engine.scan_layers", "mesh.stage"): ({"engine.scan_layers": True, "mesh.stage": 2}, ()),
    ("engine.attention_impl=pallas", "mesh.sequence"): ({"engine.attention_impl": "pallas_gpu",
                                                         "mesh.sequence": 2}, ()),
    ("model.context_attention=pass_kv", "engine.kv_cache_dtype=quantized"): (
        {"model.context_attention": "pass_kv", "engine.kv_cache_dtype": "int8", "mesh.sequence": 2}, ()),
    ("model.context_attention=pass_kv", "mla"): ({**MLA, "model.context_attention": "pass_kv"}, ()),
    ("platform=cpu", "model.dtype=bfloat16", "mesh.tensor"): ({"model.dtype": "bfloat16", "mesh.tensor": 2},
                                                              ("platform=cpu",)),
    ("engine.host_kv_cache_gb", "!engine.enable_prefix_caching"): (
        {"engine.host_kv_cache_gb": 1, "engine.enable_prefix_caching": False}, ()),
    ("engine.disk_kv_cache_dir", "!engine.host_kv_cache_gb"): (
        {"engine.disk_kv_cache_dir": "/tmp/x", "engine.disk_kv_cache_gb": 1}, ()),
    ("engine.disk_kv_cache_dir", "mesh.num_processes"): (
        {"engine.disk_kv_cache_dir": "/tmp/x", "engine.disk_kv_cache_gb": 1, "engine.host_kv_cache_gb": 1,
         "mesh.num_processes": 2, "mesh.coordinator": "127.0.0.1:1"}, ()),
    ("model.pooling", "mesh.data"): ({"model.pooling": "last", "mesh.data": 2}, ()),
    ("model.pooling", "mesh.stage"): ({"model.pooling": "mean", "mesh.stage": 2}, ()),
    ("model.pooling", "mesh.num_processes"): ({"model.score_token_ids": [1, 2], "mesh.num_processes": 2,
                                               "mesh.coordinator": "127.0.0.1:1"}, ()),
    ("model.pooling", "speculative.method=ngram/suffix/mtp"): ({"model.pooling": "cls", "speculative.method": "ngram"}, ()),
    ("mesh.data", "speculative.method=ngram/suffix/mtp"): ({"mesh.data": 2, "speculative.method": "ngram"}, ()),
    ("mesh.stage", "speculative.method=ngram/suffix/mtp"): ({"mesh.stage": 2, "speculative.method": "suffix"}, ()),
    ("mesh.sequence", "speculative.method=ngram/suffix/mtp"): ({"mesh.sequence": 2, "speculative.method": "ngram"}, ()),
    ("mesh.num_processes", "speculative.method=ngram/suffix/mtp"): (
        {"mesh.num_processes": 2, "mesh.coordinator": "127.0.0.1:1", "speculative.method": "ngram"}, ()),
    ("serve.role=prefill/decode", "speculative.method=ngram/suffix/mtp"): ({"speculative.method": "suffix"},
                                                                ("serve.role=prefill/decode",)),
    **{("speculative.method=mtp", cond): ({**MTP, **extra}, ()) for cond, extra in (
        ("engine.scan_layers", {"engine.scan_layers": True}),
        ("mesh.expert", {"model.architecture": "MixtralForCausalLM", "model.num_experts": 4,
                         "model.experts_per_token": 2, "mesh.expert": 2}),
        ("engine.host_kv_cache_gb", {"engine.host_kv_cache_gb": 1}),
        ("engine.kv_cache_dtype=quantized", {"engine.kv_cache_dtype": "int8"}),
        ("model.weight_dtype=int8", {"model.weight_dtype": "int8"}),
        ("model.weight_dtype=fp8_block", {"model.weight_dtype": "fp8_block", "model.weight_block_size": [16, 16]}),
        ("model.weight_dtype=int_group", {"model.weight_dtype": "int_group", "model.weight_group_size": 32}),
        ("dsa", DSA),
    )},
    **{("lora.max_loras", cond): ({"lora.max_loras": 2, **extra}, flags) for cond, extra, flags in (
        ("mla", MLA, ()),
        ("mesh.expert", {"model.architecture": "MixtralForCausalLM", "model.num_experts": 4,
                         "model.experts_per_token": 2, "mesh.expert": 2}, ()),
        ("linear", HYBRID, ()),
        ("mixed_kv", MIXED_KV, ()),
        ("mesh.data", {"mesh.data": 2}, ()),
        ("mesh.sequence", {"mesh.sequence": 2}, ()),
        ("mesh.stage", {"mesh.stage": 2}, ()),
        ("engine.scan_layers", {"engine.scan_layers": True}, ()),
        ("mesh.num_processes", {"mesh.num_processes": 2, "mesh.coordinator": "127.0.0.1:1"}, ()),
        ("model.weight_dtype=int8", {"model.weight_dtype": "int8"}, ()),
        ("model.weight_dtype=fp8_block", {"model.weight_dtype": "fp8_block", "model.weight_block_size": [16, 16]},
         ()),
        ("model.weight_dtype=int_group", {"model.weight_dtype": "int_group", "model.weight_group_size": 32}, ()),
        ("speculative.method=ngram/suffix/mtp", {"speculative.method": "suffix"}, ()),
        ("serve.role=prefill/decode", {}, ("serve.role=prefill/decode",)),
    )},
    ("lora.max_loras", "moe", "mesh.tensor"): ({"lora.max_loras": 2, "model.architecture": "Qwen3MoeForCausalLM",
                                              "model.num_experts": 4, "model.experts_per_token": 2,
                                              "mesh.tensor": 2}, ()),
    **{("mrope", cond): ({**MROPE, **extra}, flags) for cond, extra, flags in (
        ("mesh.data", {"mesh.data": 2}, ()),
        ("mesh.sequence", {"mesh.sequence": 2}, ()),
        ("mesh.stage", {"mesh.stage": 2}, ()),
        ("mesh.num_processes", {"mesh.num_processes": 2, "mesh.coordinator": "127.0.0.1:1"}, ()),
        ("engine.scan_layers", {"engine.scan_layers": True}, ()),
        ("speculative.method=ngram/suffix/mtp", {"speculative.method": "ngram"}, ()),
        ("lora.max_loras", {"lora.max_loras": 2}, ()),
        ("model.pooling", {"model.pooling": "last"}, ()),
        ("engine.host_kv_cache_gb", {"engine.host_kv_cache_gb": 1}, ()),
        ("serve.role=prefill/decode", {}, ("serve.role=prefill/decode",)),
    )},
    # a request's flag (engine/vision/loading.py images_refused), so any model shows it
    **{("images=bidirectional", cond): (extra, ("images=bidirectional",)) for cond, extra in (
        ("mesh.data", {"mesh.data": 2}),
        ("mesh.sequence", {"mesh.sequence": 2}),
        ("mesh.stage", {"mesh.stage": 2}),
        ("mesh.num_processes", {"mesh.num_processes": 2, "mesh.coordinator": "127.0.0.1:1"}),
        ("engine.scan_layers", {"engine.scan_layers": True}),
        ("speculative.method=ngram/suffix/mtp", {"speculative.method": "ngram"}),
        ("lora.max_loras", {"lora.max_loras": 2}),
        ("model.pooling", {"model.pooling": "last"}),
        ("engine.host_kv_cache_gb", {"engine.host_kv_cache_gb": 1}),
    )},
}


def test_every_rule_has_a_breaking_config():
    assert set(BREAKS) == {r.when for r in RULES}


@pytest.mark.parametrize("rule", RULES, ids=lambda r: "+".join(r.when))
def test_each_rule_refuses_at_config_time_in_one_line(rule):
    overrides, flags = BREAKS[rule.when]
    with pytest.raises(ConfigError) as e:
        config = load_config("tiny_random", {**TINY, **overrides})  # config.json / TOML only: no weights
        validate(config, extra=flags)  # platform and role flags: what the loader and serve add
    msg = str(e.value)
    assert "\n" not in msg and rule.why in msg and rule.change in msg, msg
    # without the rule's last setting the same config is accepted
    *kept, last = rule.when
    if last in CAPABILITIES and not flags:
        key, _, value = last.partition("=")
        default = {"mesh.tensor": 1, "mesh.sequence": 1, "mesh.stage": 1, "engine.scan_layers": False}.get(key)
        if default is not None:
            load_config("tiny_random", {**TINY, **overrides, key: default})


def test_accepted_combinations_pass():
    load_config("tiny_random", {**TINY, "mesh.tensor": 2, "mesh.sequence": 2, "engine.kv_cache_dtype": "int8"})
    load_config("tiny_random", {**TINY, **HYBRID, "mesh.tensor": 2, "engine.kv_cache_dtype": "int8"})
    validate(load_config("tiny_random", {**TINY, "model.dtype": "bfloat16"}), platform="cpu")
    validate(load_config("tiny_random", {**TINY, "model.dtype": "bfloat16", "mesh.tensor": 2}), platform="gpu")
    # PD with data replicas and over several processes (tests/test_kv_transfer_data.py, test_disagg_multihost.py)
    validate(load_config("tiny_random", {**TINY, "mesh.data": 2}), extra=("serve.role=prefill/decode",))
    validate(load_config("tiny_random", {**TINY, "mesh.num_processes": 2, "mesh.coordinator": "127.0.0.1:1"}),
             extra=("serve.role=prefill/decode",))


# what a test must set to run a column (prefix caching is on by default: its tests read hits)
SETS = {"mesh.num_processes": "process", "engine.scan_layers": "scan", "model.weight_dtype=int8": "int8",
        "model.weight_dtype=fp8_block": "fp8_block", "model.weight_dtype=int_group": "int_group",
        "engine.kv_cache_dtype=int8": "int8", "engine.kv_cache_dtype=float8_e4m3fn": "float8_e4m3fn",
        "engine.enable_prefix_caching": "cached", "engine.host_kv_cache_gb": "host_kv_cache_gb",
        "engine.disk_kv_cache_dir": "disk_kv_cache_dir"}


def _source_with_helpers(path: str) -> str:
    """A test file's text and that of the tests/ helper modules it imports."""
    text = open(path).read()
    for mod in re.findall(r"^(?:from|import) (\w+)", text, re.M):
        helper = os.path.join(ROOT, "tests", mod + ".py")
        if os.path.isfile(helper):
            text += open(helper).read()
    return text


@pytest.mark.parametrize("ev", EVIDENCE, ids=lambda ev: ev.test.split("/")[-1])
def test_each_named_test_exists_and_sets_its_capability(ev):
    path, _, node = ev.test.partition("::")
    func, _, param = node.partition("[")
    source = open(os.path.join(ROOT, path)).read()
    assert re.search(rf"^(?:async )?def {func}\(", source, re.M), ev.test
    if param:
        assert f'"{param[:-1]}"' in source or f"'{param[:-1]}'" in source, ev.test
    text = _source_with_helpers(os.path.join(ROOT, path))
    for col in ev.columns:
        assert SETS.get(col, col) in text, (ev.test, col)
    families = {f.name for f in registry.families()}
    assert set(ev.families) <= families


def test_no_refused_cell_claims_a_test():
    for family in registry.families():
        refused = {c for c, cell in support_matrix.family_support(family).items() if cell.status == "refused"}
        claimed = {c for ev in EVIDENCE if family.name in ev.families for c in ev.columns}
        assert not refused & claimed, (family.name, refused & claimed)
        assert family_kinds(family)  # every family declares what it holds


def test_readme_and_capabilities_doc_are_generated():
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert support_matrix.MATRIX_BEGIN in readme and support_matrix.MATRIX_END in readme
    assert support_matrix.render_readme(readme) == readme, "run: python -m jaxfill.engine.capabilities.support_matrix"
    doc = open(os.path.join(ROOT, "docs", "capabilities.md")).read()
    assert doc == support_matrix.capabilities_doc(), "run: python -m jaxfill.engine.capabilities.support_matrix"


def test_models_json_has_every_architecture_with_a_test_per_tested_cell(capsys):
    import json

    from jaxfill.serving.cli import main

    assert main(["models", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["architecture"] for r in rows] == list(registry.architectures())
    for r in rows:
        assert set(r["supports"]) == set(CAPABILITIES)
        tested = {c for c, s in r["supports"].items() if s == "tested"}
        assert tested == set(r["test"]) and all(r["test"][c].startswith("tests/") for c in tested)
        assert {c for c, s in r["supports"].items() if s == "refused"} == set(r["refused"])
