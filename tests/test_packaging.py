"""One import namespace: the wheel holds `jaxfill/` alone, a user's own `models.py` or
`engine/` never shadows ours, nothing imports the folders bare, and every runtime
dependency is one the library really imports."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("engine", "models", "serving", "pallas_kernels", "configs")
LIBRARY = [os.path.join(ROOT, "__init__.py")] + [
    os.path.join(d, f) for folder in FOLDERS for d, _, fs in os.walk(os.path.join(ROOT, folder)) for f in fs
    if f.endswith(".py")]


def _python_files(*folders: str) -> list[str]:
    return [os.path.join(d, f) for folder in folders for d, _, fs in os.walk(os.path.join(ROOT, folder))
            for f in fs if f.endswith(".py")]


def _imported_top_levels(path: str) -> set[str]:
    tree = ast.parse(open(path).read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_wheel_holds_only_the_jaxfill_package(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path), ROOT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("jaxfill-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"jaxfill", wheel.name.split("-")[0] + "-" +
                                                 wheel.name.split("-")[1] + ".dist-info"}
    for needed in ("jaxfill/__init__.py", "jaxfill/engine/engine.py", "jaxfill/configs/tiny_random.toml",
                   "jaxfill/configs/hardware.toml", "jaxfill/serving/proto/jaxfill/v1/generation.proto",
                   "jaxfill/pallas_kernels/ragged_paged_attention/tpu.py", "jaxfill/configs/tiny/tokenizer.json",
                   "jaxfill/configs/tiny/tokenizer_config.json"):
        assert needed in names, needed
    # every module of the code folders, subpackages included (pyproject.toml lists them one by one)
    code = [p for p in LIBRARY if os.path.relpath(p, ROOT).split(os.sep)[0] != "configs"]
    missing = [os.path.relpath(p, ROOT) for p in code
               if "jaxfill/" + os.path.relpath(p, ROOT).replace(os.sep, "/") not in names]
    assert not missing, f"not in the wheel (list their packages in pyproject.toml): {missing}"
    assert not any(n.startswith("jaxfill/tests/") or n.startswith("jaxfill/benchmarks/") for n in names)


@pytest.mark.slow
def test_a_users_own_models_and_engine_do_not_shadow_ours(tmp_path):
    (tmp_path / "models.py").write_text("raise ImportError('the user models.py was imported')\n")
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "__init__.py").write_text("raise ImportError('the user engine/ was imported')\n")
    (tmp_path / "serving.py").write_text("raise ImportError('the user serving.py was imported')\n")
    script = ("from jaxfill import Engine, SamplingParams, load_config\n"
              "e = Engine(load_config('tiny_random', {'engine.num_pages': 32, 'engine.max_model_len': 128,"
              " 'engine.token_buckets': [16], 'engine.max_num_batched_tokens': 16,"
              " 'engine.attention_impl': 'reference'}), progress=False)\n"
              "print(e.generate(['Hi'], SamplingParams(max_tokens=3))[0].token_ids)\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert len(eval(out.stdout.strip().splitlines()[-1])) == 3


@pytest.mark.parametrize("path", LIBRARY + _python_files("tests", "benchmarks"),
                         ids=lambda p: os.path.relpath(p, ROOT))
def test_no_bare_imports_of_the_folders(path):
    bare = _imported_top_levels(path) & set(FOLDERS)
    assert not bare, f"imports {sorted(bare)} bare; use jaxfill.{sorted(bare)[0]}"


def test_every_runtime_dependency_is_imported_by_the_library():
    deps = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]["dependencies"]
    import_name = {"orbax-checkpoint": "orbax", "grpcio": "grpc", "grpcio-health-checking": "grpc_health",
                   "grpcio-reflection": "grpc_reflection", "protobuf": "google",
                   "smg-grpc-proto": "smg_grpc_proto"}
    used = set().union(*(_imported_top_levels(p) for p in LIBRARY))
    for dep in deps:
        name = dep.split(">")[0].split("=")[0].split("<")[0].strip()
        if name == "jaxlib":  # the compiled backend jax itself loads; never imported by name
            continue
        assert import_name.get(name, name) in used, f"{name} is a runtime dependency nothing imports"
    assert "matplotlib" not in " ".join(deps), "matplotlib belongs to the optional `plots` extra"
