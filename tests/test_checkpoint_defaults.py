"""`--model DIR` without `--config` (issue 44 item 4): the engine settings come from the
checkpoint, not from the tiny model's toy preset; the checkpoint's name is in logs and plans;
config.json's underscore keys (transformers' own metadata) are inert; `--compile-cache none`
means no persistent cache in every command."""

import json
import os
import subprocess
import sys

import jax
import pytest

from jaxfill.engine.config import load_config
from jaxfill.models.config import ConfigError
from jaxfill.models.families import registry

# Keys transformers 4 writes beside the math (and any key it may add with a leading underscore)
UNDERSCORE_KEYS = {"_attn_implementation_autoset": True, "_model_name_or_path": "elsewhere/x",
                   "_commit_hash": "0123abc", "_some_future_key": {"a": [1, 2]}}
# Meta-Llama-3-8B's published config.json (no weights needed to match a preset)
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
             "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
             "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192,
             "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
             "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.40.0.dev0",
             "use_cache": True, "vocab_size": 128256}
LLAMA3_1_8B = {**LLAMA3_8B, "max_position_embeddings": 131072, "eos_token_id": [128001, 128008, 128009],
               "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"}}


def _edit(directory: str, drop=(), **fields) -> str:
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    config = {k: v for k, v in {**config, **fields}.items() if k not in drop}
    with open(path, "w") as f:
        json.dump(config, f)
    return directory


def _config_only(directory, config: dict) -> str:
    """A model directory holding only config.json: enough for load_config and `jaxfill plan`."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return str(directory)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random-init Llama with 8192 positions (twice tiny's 4096) named as transformers 4 named it."""
    from hf_models import make_hf_checkpoint

    directory = make_hf_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "llama-8k"), "llama",
                                   max_position_embeddings=8192)
    return _edit(directory, _name_or_path="acme/Llama-8k")


def test_a_checkpoint_without_a_preset_takes_its_own_settings(checkpoint):
    config = load_config(model_path=checkpoint)
    e = config.engine
    assert config.name == "acme/Llama-8k"
    assert e.max_model_len == 8192  # its max_position_embeddings, not tiny's 4096
    assert e.num_pages == 0  # the pool sized from device memory, not tiny's 1024 pages
    assert (e.max_num_seqs, e.max_num_batched_tokens) == (64, 8192)  # as the published models' presets
    assert load_config(None, model_path=checkpoint).engine == e


def test_its_name_is_the_directory_without_name_or_path(tmp_path):
    base = {k: v for k, v in LLAMA3_8B.items()}
    assert load_config(model_path=_config_only(tmp_path / "My-Model", base)).name == "My-Model"
    named = _config_only(tmp_path / "b", {**base, "_name_or_path": "/home/u/ckpts/Llama-3-8B-ft/"})
    assert load_config(model_path=named).name == "Llama-3-8B-ft"  # a local path: its last part
    other = _config_only(tmp_path / "c", {**base, "_model_name_or_path": "org/Other"})
    assert load_config(model_path=other).name == "org/Other"


def test_explicit_overrides_win(checkpoint):
    config = load_config(None, {"engine.max_model_len": 1024, "engine.num_pages": 64, "engine.max_num_seqs": 4,
                                "engine.max_num_batched_tokens": 128}, checkpoint)
    e = config.engine
    assert (e.max_model_len, e.num_pages, e.max_num_seqs, e.max_num_batched_tokens) == (1024, 64, 4, 128)
    with pytest.raises(ConfigError, match=r"max_model_len \(16384\) exceeds"):
        load_config(None, {"engine.max_model_len": 16384}, checkpoint)


def test_an_explicit_preset_keeps_todays_behaviour(checkpoint):
    tiny = load_config("tiny")
    config = load_config("tiny", model_path=checkpoint)
    assert config.name == "tiny" and config.engine == tiny.engine  # 4096 <= 8192: nothing shrinks
    assert config.model.max_position_embeddings == 8192 and config.model_path == checkpoint
    assert load_config().name == "tiny" and load_config(None).engine == tiny.engine  # no checkpoint: tiny


def test_plan_names_the_checkpoint(checkpoint, capsys):
    from jaxfill.serving.cli import main

    base = ["plan", "--model", checkpoint, "--hardware", "h100_sxm", "--prompt-len", "128", "--compile-cache", "none"]
    assert main([*base, "--json"]) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    assert row["config"] == "acme/Llama-8k" and row["prompt_len"] == 128
    assert main(base) == 0
    assert "model   acme/Llama-8k:" in capsys.readouterr().out


def test_a_matching_preset_is_named(tmp_path, caplog):
    from jaxfill.engine.checkpoint_settings import matching_preset

    assert matching_preset(registry.config_from_hf(LLAMA3_8B)) == "llama3_8b"
    assert matching_preset(registry.config_from_hf(LLAMA3_1_8B)) == "llama3_1_8b"  # same shapes, longer rope
    assert matching_preset(registry.config_from_hf({**LLAMA3_8B, "num_hidden_layers": 30})) is None
    with caplog.at_level("INFO", logger="jaxfill.config"):
        config = load_config(model_path=_config_only(tmp_path / "Meta-Llama-3-8B", LLAMA3_8B))
    assert config.engine.max_model_len == 8192 and config.name == "Meta-Llama-3-8B"
    assert any("--config llama3_8b" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("INFO", logger="jaxfill.config"):
        load_config("llama3_8b", model_path=str(tmp_path / "Meta-Llama-3-8B"))  # chosen: nothing to suggest
    assert not any("--config" in r.getMessage() for r in caplog.records)


def test_underscore_keys_are_inert_in_every_family(checkpoint, tmp_path):
    for family in registry.families():
        family.check_fields(UNDERSCORE_KEYS)  # never refused
        with pytest.raises(ConfigError, match="attn_implementation_autoset"):
            family.check_fields({"attn_implementation_autoset": True})  # without the underscore: refused
    plain = load_config(model_path=checkpoint)
    import shutil

    copy = _edit(shutil.copytree(checkpoint, tmp_path / "copy"), **UNDERSCORE_KEYS)
    assert load_config(model_path=copy).model == plain.model
    gemma = {"architectures": ["Gemma3ForConditionalGeneration"], "_name_or_path": "g/3",
             "text_config": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 160,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                             "head_dim": 16, **UNDERSCORE_KEYS}}
    assert registry.config_from_hf(gemma).num_layers == 2  # nested text_config too


@pytest.fixture
def jax_cache_config():
    """Restores the process's persistent-cache settings after an in-process CLI run."""
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    saved = {n: getattr(jax.config, n) for n in names}
    yield
    for n, v in saved.items():
        jax.config.update(n, v)


@pytest.mark.slow  # 33 s in a full run (2026-12-07, 2 loaded cores)
def test_compile_cache_none_writes_nothing_in_generate(checkpoint, tmp_path):
    """The Engine used to turn the default cache back on after the CLI turned it off."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(JAXFILL_COMPILE_CACHE=str(tmp_path / "xla"), XDG_CACHE_HOME=str(tmp_path / "home"))
    out = subprocess.run([sys.executable, "-m", "jaxfill.serving.cli", "generate", "--model", checkpoint,
                          "--prompt-ids", "1,2,3", "--max-tokens", "2", "--json", "--quiet", "--compile-cache", "none",
                          "--set", "engine.num_pages=32", "--set", "engine.max_model_len=256",
                          "--set", "engine.max_num_batched_tokens=16", "--set", "engine.max_num_seqs=4"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout.splitlines()[-1])["token_ids"]) == 2
    assert not (tmp_path / "xla").exists() and not (tmp_path / "home").exists(), os.listdir(tmp_path)


def test_compile_cache_none_in_serve(monkeypatch, tmp_path, jax_cache_config):
    from jaxfill.serving.cli import main
    from jaxfill.serving.commands import serve

    monkeypatch.setenv("JAXFILL_COMPILE_CACHE", str(tmp_path / "xla"))
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    seen = {}

    async def no_server(args, engine, log):  # the engine is built; what cache does jax have now?
        seen["dir"] = jax.config.jax_compilation_cache_dir
        return 0

    monkeypatch.setattr(serve, "_serve", no_server)
    assert main(["serve", "--config", "tiny_random", "--compile-cache", "none", "--no-warmup",
                 "--set", "engine.num_pages=32", "--set", "engine.max_model_len=256"]) == 0
    assert seen == {"dir": None} and not (tmp_path / "xla").exists()


def test_generate_sizes_the_pool_to_its_prompts(checkpoint):
    """`generate` knows its workload: with engine.num_pages = 0 it takes the pages its prompts
    need, a power of two of at least MIN_POOL_PAGES (a shared compile cache), instead of a
    pool that fills memory; explicit counts and workloads past MAX_POOL_PAGES are kept."""
    from jaxfill.serving.commands.generate import MAX_POOL_PAGES, MIN_POOL_PAGES, pool_for_prompts

    config = load_config(None, {}, checkpoint)
    page = config.engine.page_size
    pages = lambda c: c.engine.num_pages  # noqa: E731
    assert pages(pool_for_prompts(config, [10], 16, at_once=False)) == MIN_POOL_PAGES
    prompts = [100 * page] * 6  # 100 pages each, 101 with the answer
    assert pages(pool_for_prompts(config, prompts, 1, at_once=False)) == 128  # one at a time: 1 + 101
    assert pages(pool_for_prompts(config, prompts, 1, at_once=True)) == 1024  # together: 1 + 606
    assert 1 + 11 * 101 > MAX_POOL_PAGES
    assert pages(pool_for_prompts(config, prompts * 2, 1, at_once=True)) == 0  # sized from memory
    explicit = load_config(None, {"engine.num_pages": 40}, checkpoint)
    assert pages(pool_for_prompts(explicit, [10], 16, at_once=False)) == 40
    spec = load_config(None, {"speculative.method": "ngram", "speculative.num_tokens": 4}, checkpoint)
    assert pages(pool_for_prompts(spec, [127 * page - 3], 1, at_once=False)) == 256  # 1 + 128 with k=4 slots


def test_generate_builds_its_engine_on_the_sized_pool(checkpoint, monkeypatch):
    from jaxfill.engine import engine as engine_module
    from jaxfill.serving.cli import main

    seen = []

    class Stop(Exception):
        pass

    def capture(config, **kwargs):
        seen.append(config.engine.num_pages)
        raise Stop

    monkeypatch.setattr(engine_module, "Engine", capture)
    with pytest.raises(Stop):
        main(["generate", "--model", checkpoint, "--prompt-ids", "1,2,3", "--max-tokens", "4", "--quiet"])
    assert seen == [64]
