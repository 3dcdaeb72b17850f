"""The CLI's persistent XLA compilation cache: on by default, overridable, 'none' turns it off."""

import os
import subprocess
import sys

from jaxfill.engine.compile_cache import default_cache_dir

SCRIPT = """
import sys, jax, jax.numpy as jnp
from jaxfill.engine.compile_cache import enable_compile_cache
print(enable_compile_cache(None if sys.argv[1] == "default" else sys.argv[1]))
jax.jit(lambda x: jnp.sin(x) * 3)(jnp.arange(8.0)).block_until_ready()
"""


def _run(arg: str, env: dict) -> str:
    env = {k: v for k, v in {**os.environ, **env}.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, arg], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_default_is_the_user_cache_dir_and_programs_land_there(tmp_path):
    used = _run("default", {"XDG_CACHE_HOME": str(tmp_path), "JAXFILL_COMPILE_CACHE": ""})
    assert used == str(tmp_path / "jaxfill" / "xla")
    assert os.listdir(used), "the jitted program was not written to the cache"


def test_explicit_dir_and_none(tmp_path):
    chosen = tmp_path / "mine"
    assert _run(str(chosen), {"XDG_CACHE_HOME": str(tmp_path / "unused")}) == str(chosen)
    assert os.listdir(chosen) and not (tmp_path / "unused").exists()
    assert _run("none", {"XDG_CACHE_HOME": str(tmp_path / "off")}) == "None"
    assert not (tmp_path / "off").exists()


def test_env_var_beats_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXFILL_COMPILE_CACHE", str(tmp_path))
    assert default_cache_dir() == str(tmp_path)


def test_every_model_command_takes_the_flag():
    from jaxfill.serving.cli import build_parser

    for argv in (["generate", "--prompt", "x"], ["serve"], ["plan"], ["bench", "prefill"]):
        args = build_parser().parse_args([*argv, "--compile-cache", "none"])
        assert args.compile_cache == "none"
