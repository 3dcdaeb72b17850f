"""The package's import graph: no cycle anywhere and layers only import downwards.

Every `import` / `from ... import` in every module counts, including those inside
functions (a function-level import hides a cycle from the interpreter, not from readers).
Layers, top to bottom: serving -> engine -> models -> pallas_kernels.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("pallas_kernels", "models", "engine", "serving")  # lowest layer first
LAYER = {name: rank for rank, name in enumerate(PACKAGES)}


def modules() -> dict[str, str]:
    """Dotted name ('jaxfill.models.decoder', 'jaxfill.models' for its __init__) -> file."""
    out = {"jaxfill": os.path.join(ROOT, "__init__.py")}
    for package in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(ROOT, package)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            rel = os.path.relpath(folder, ROOT).split(os.sep)
            for name in files:
                if name.endswith(".py"):
                    parts = rel if name == "__init__.py" else rel + [name[:-3]]
                    out[".".join(["jaxfill", *parts])] = os.path.join(folder, name)
    return out


def imported(module: str, path: str, known: set[str]) -> set[str]:
    """The project modules `module` imports anywhere in its file."""
    is_package = path.endswith("__init__.py")
    package = module if is_package else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import name`: the submodule if `name` is one, else pkg itself.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:  # `import jaxfill.models.x.attr` style
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
    return targets


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imported(m, p, set(mods)) for m, p in mods.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYER.get(parts[1]) if len(parts) > 1 else None


def test_finds_a_planted_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(edges) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_sees_function_level_imports():
    mods = modules()
    edges = graph()
    assert len(mods) > 40, sorted(mods)
    # engine/loading.py imports the checkpoint reader inside a function.
    assert "jaxfill.models.checkpoint" in edges["jaxfill.engine.loading"], edges["jaxfill.engine.loading"]


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, " -> ".join(cycle)


def test_layers_only_import_downwards():
    bad = [f"{src} -> {dst}" for src, dsts in graph().items() for dst in dsts
           if layer(src) is not None and layer(dst) is not None and layer(dst) > layer(src)]
    assert not bad, bad
    assert not any(dst == "jaxfill" for src, dsts in graph().items() for dst in dsts if layer(src) is not None)


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_imports_in_a_fresh_interpreter(package):
    """Import order that would only work thanks to an earlier import shows up here: each
    layer's modules are imported first thing in a new process, in sorted order."""
    names = sorted(m for m in modules() if layer(m) == LAYER[package])
    code = ("import importlib, sys\n"
            "for name in sys.argv[1:]:\n"
            "    importlib.import_module(name)\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
