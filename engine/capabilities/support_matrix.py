"""What runs on each architecture, derived from the capability table and its evidence.

One source for `jaxfill models` (text and --json), the README's matrix and
docs/capabilities.md: a cell is "refused" where a rule of engine/capabilities/table.py refuses
it for the family's kinds, "tested" where engine/capabilities/evidence.py names a test that
runs it, "untested" otherwise. tests/test_capabilities.py regenerates the documents and
compares them, so they cannot drift from the table.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxfill.engine.capabilities.table import CAPABILITIES, family_kinds, refused_columns
from jaxfill.engine.capabilities.evidence import tests_of

COLUMNS = tuple(CAPABILITIES)
SHORT = {"mesh.tensor": "tensor", "mesh.sequence": "sequence", "mesh.data": "data", "mesh.stage": "stage",
         "mesh.expert": "expert", "mesh.num_processes": "multi-process", "engine.scan_layers": "scan",
         "model.weight_dtype=int8": "int8 weights", "model.weight_dtype=fp8_block": "fp8 weights",
         "model.weight_dtype=int_group": "int4/int8 groups",
         "engine.kv_cache_dtype=int8": "int8 KV",
         "engine.kv_cache_dtype=float8_e4m3fn": "fp8 KV", "engine.enable_prefix_caching": "prefix cache",
         "engine.host_kv_cache_gb": "host tier", "engine.disk_kv_cache_dir": "disk tier", "model.pooling": "pooling"}
MATRIX_BEGIN, MATRIX_END = "<!-- capability-matrix:begin -->", "<!-- capability-matrix:end -->"


class Cell(NamedTuple):
    status: str  # tested | untested | refused
    detail: str  # the test's node id, or the refusal's reason and the key to change


def family_support(family) -> dict[str, Cell]:
    refused = refused_columns(family_kinds(family))
    tests = tests_of(family.name)
    out = {}
    for col in COLUMNS:
        if col in refused:
            out[col] = Cell("refused", f"{refused[col].why}; change {refused[col].change}")
        elif col in tests:
            out[col] = Cell("tested", tests[col])
        else:
            out[col] = Cell("untested", "")
    return out


def rows() -> list[dict]:
    """One dict per architecture, what `jaxfill models --json` prints."""
    from jaxfill.engine.config import preset_names, read_preset
    from jaxfill.models.families import registry

    presets: dict[str, list[str]] = {}
    for name in preset_names():
        arch = read_preset(name)[1].get("model", {}).get("architecture", "LlamaForCausalLM")
        presets.setdefault(arch, []).append(name)
    out = []
    for arch in registry.architectures():
        family = registry.family_of(arch)
        cells = family_support(family)
        out.append({"architecture": arch, "family": family.name, "kinds": sorted(family_kinds(family)),
                    "supports": {c: cell.status for c, cell in cells.items()},
                    "test": {c: cell.detail for c, cell in cells.items() if cell.status == "tested"},
                    "refused": {c: cell.detail for c, cell in cells.items() if cell.status == "refused"},
                    "parity": family.tested, "presets": presets.get(arch, [])})
    return out


MARK = {"tested": "✓", "untested": "·", "refused": "✗"}


def _short(architecture: str) -> str:
    """`Qwen3_5MoeForCausalLM` -> Qwen3_5Moe; an image-text class names its text tower, unless
    its images are read too (engine/vision/)."""
    from jaxfill.engine.vision.loading import VISION_ARCHITECTURES

    images = " (images)" if architecture in VISION_ARCHITECTURES else " (text tower)"
    return architecture.replace("ForCausalLM", "").replace("ForConditionalGeneration", images)


def matrix_markdown() -> str:
    """The README's table, a row per family (its architectures share every cell): a tested
    cell links the test file that runs it (reference links keep the rows short)."""
    lines = ["| family: architectures | " + " | ".join(SHORT[c] for c in COLUMNS) + " |",
             "|---|" + "---|" * len(COLUMNS)]
    by_family: dict[str, list[dict]] = {}
    for row in rows():
        by_family.setdefault(row["family"], []).append(row)
    files: dict[str, str] = {}  # test file -> its reference label
    for name, group in by_family.items():
        row, cells = group[0], []
        for c in COLUMNS:
            status = row["supports"][c]
            if status == "tested":
                path = row["test"][c].split("::")[0]
                label = files.setdefault(path, f"t{len(files) + 1}")
                cells.append(f"[✓][{label}]")
            else:
                cells.append(MARK[status])
        archs = ", ".join(_short(r["architecture"]) for r in group)
        lines.append(f"| {name}: {archs} | " + " | ".join(cells) + " |")
    legend = ("✓ runs, and the linked test compares it with a reference; · accepted but no test runs it "
              "(untested); ✗ refused at config time, before any weight is read. Every cell's test and every "
              "refusal's reason: [docs/capabilities.md](docs/capabilities.md), or `jaxfill models --json`.")
    refs = [f"[{label}]: {path}" for path, label in files.items()]
    return "\n".join(lines + ["", legend, ""] + refs)


def capabilities_doc() -> str:
    """docs/capabilities.md: every cell of every family, its test or its reason."""
    from jaxfill.engine.capabilities.table import RULES
    from jaxfill.models.families import registry

    out = ["# What runs where (generated)", "",
           "Generated from engine/capabilities/table.py and engine/capabilities/evidence.py by "
           "`python -m jaxfill.engine.capabilities.support_matrix`; tests/test_capabilities.py fails when this file "
           "differs from what they say.", ""]
    for family in registry.families():
        out.append(f"## {family.name} ({', '.join(family.architectures)}): {', '.join(sorted(family_kinds(family)))}")
        out.append("")
        for col, cell in family_support(family).items():
            out.append(f"- `{col}`: {cell.status}" + (f": {cell.detail}" if cell.detail else ""))
        out.append("")
    out += ["## Every rule", "", "Each combination below is refused with one line naming it and the key to change.",
            ""]
    out += [f"- {' + '.join(f'`{c}`' for c in r.when)}: {r.why}; change {r.change}" for r in RULES]
    return "\n".join(out) + "\n"


def render_readme(readme: str) -> str:
    """README text with the matrix between its markers replaced by the current one."""
    head, _, rest = readme.partition(MATRIX_BEGIN)
    _, _, tail = rest.partition(MATRIX_END)
    return f"{head}{MATRIX_BEGIN}\n{matrix_markdown()}\n{MATRIX_END}{tail}"


if __name__ == "__main__":  # regenerate the documents: python -m jaxfill.engine.capabilities.support_matrix
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # engine/capabilities/
    with open(os.path.join(root, "docs", "capabilities.md"), "w") as f:
        f.write(capabilities_doc())
    path = os.path.join(root, "README.md")
    with open(path) as f:
        text = f.read()
    if MATRIX_BEGIN in text:
        with open(path, "w") as f:
            f.write(render_readme(text))
