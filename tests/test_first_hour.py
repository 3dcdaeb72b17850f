"""The first hour of a new user (issue 32): what start-up says, what --json carries,
which cache the library uses, how fast the CLI starts, what a checkpoint without a
tokenizer prints."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE_TWICE = """
import json, sys
from jaxfill import Engine
engine = Engine.from_config("tiny_random", overrides={"engine.token_buckets": [16], "engine.max_num_batched_tokens": 16,
                                                       "engine.num_pages": 16, "engine.max_model_len": 64})
print("RESULT " + json.dumps(engine.warmup_programs))
"""


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "JAXFILL_COMPILE_CACHE")}
    env.update(extra)
    return env


def run_engine(env):
    out = subprocess.run([sys.executable, "-c", ENGINE_TWICE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return tuple(json.loads(line[len("RESULT "):])), out.stderr


@pytest.mark.slow  # 51 s in a full run (2026-12-07, 2 loaded cores)
def test_the_library_uses_the_persistent_cache_and_says_it_loaded(tmp_path):
    env = clean_env(JAXFILL_COMPILE_CACHE=str(tmp_path / "xla"))
    (loaded, compiled), err = run_engine(env)
    assert compiled >= 1 and "compiled" in err
    (loaded2, compiled2), err2 = run_engine(env)
    assert compiled2 == 0 and loaded2 >= compiled, (loaded2, compiled2)
    assert "loaded" in err2 and "from the compile cache" in err2 and "compiled" not in err2.split("preparing")[-1]
    assert os.listdir(tmp_path / "xla")


def jaxfill_cli(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "jaxfill.serving.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.mark.slow
def test_generate_json_keeps_progress_on_stderr_and_quiet_drops_it():
    base = ["generate", "--config", "tiny_random", "--prompt-ids", "1,2,3", "--max-tokens", "2", "--json",
            "--set", "engine.token_buckets=[16]", "--set", "engine.max_num_batched_tokens=16"]
    loud, quiet = jaxfill_cli(*base), jaxfill_cli(*base, "--quiet")
    for out in (loud, quiet):
        assert out.returncode == 0, out.stderr
        assert [json.loads(line)["token_ids"] for line in out.stdout.splitlines()]  # stdout: JSON only
    # generate compiles a bucket when a step first needs it (serving/commands/generate.py)
    assert "step bucket 16x" in loud.stderr and "on first use" in loud.stderr and "preparing" not in loud.stderr
    assert "step bucket" not in quiet.stderr and "step programs" not in quiet.stderr


def test_a_checkpoint_without_tokenizer_says_so_once(hf_dirs):
    # Without --config the checkpoint's engine settings apply (a pool of 90% of free RAM on
    # CPU, an 8192-token budget): bounded here, as a CPU test must
    out = jaxfill_cli("generate", "--model", hf_dirs["llama"], "--prompt-ids", "1,2,3", "--max-tokens", "2",
                      "--json", "--quiet", "--set", "engine.num_pages=64", "--set", "engine.max_num_seqs=16",
                      "--set", "engine.max_num_batched_tokens=256")
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("no tokenizer") == 1 and "text is not decoded" in out.stderr
    assert len(json.loads(out.stdout.splitlines()[-1])["token_ids"]) == 2


def test_missing_libtpu_line_is_dropped_and_real_backend_errors_are_kept():
    import logging

    from jaxfill.models.progress import quiet_backend_probe

    quiet_backend_probe()
    quiet_backend_probe()  # idempotent
    logger = logging.getLogger("jax._src.xla_bridge")
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        logger.warning("Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so: No such file")
        logger.warning("Unable to initialize backend 'cuda': no CUDA devices")
    finally:
        logger.removeHandler(handler)
    assert seen == ["Unable to initialize backend 'cuda': no CUDA devices"]
    assert len([f for f in logger.filters if type(f).__name__ == "_NoMissingLibtpu"]) == 1


def test_progress_bar_is_plain_text_without_ipywidgets(monkeypatch):
    import importlib.util

    from jaxfill.models import progress

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    bar = progress.progress_bar(range(3), disable=True)
    assert type(bar).__module__ == "tqdm.std"
    assert list(bar) == [0, 1, 2]


def test_the_cli_parser_and_client_do_not_import_jax_while_the_public_api_still_works():
    """`jaxfill --help` and `jaxfill client` start without jax (1.5 s -> 0.2 s measured,
    2026-12-02); `from jaxfill import Engine` imports it on first use."""
    probe = ("import sys, jaxfill.serving.cli as c\n"
             "c.build_parser()\n"
             "import jaxfill.serving.commands.client\n"
             "print('jax' in sys.modules)\n"
             "from jaxfill import Engine, SamplingParams, load_config\n"
             "print('jax' in sys.modules, Engine.__name__, SamplingParams.__name__, load_config.__name__)\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True", "Engine", "SamplingParams", "load_config"]
