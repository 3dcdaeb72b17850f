"""`jaxfill models`: the model registry (models/families/): each architecture, its family,
what runs on it and which presets carry its published shapes."""

from __future__ import annotations

import json

COMMAND = ("models",)
HELP = "list the supported architectures, their families, layouts and presets"


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object per architecture on stdout")


def rows() -> list[dict]:
    from jaxfill.engine.config import preset_names, read_preset
    from jaxfill.models.families import registry

    presets: dict[str, list[str]] = {}
    for name in preset_names():
        arch = read_preset(name)[1].get("model", {}).get("architecture", "LlamaForCausalLM")
        presets.setdefault(arch, []).append(name)
    return [{"architecture": arch, "family": registry.family_of(arch).name,
             "supports": list(registry.family_of(arch).supports), "tested": registry.family_of(arch).tested,
             "presets": presets.get(arch, [])} for arch in registry.architectures()]


def run(args) -> int:
    table = rows()
    if args.json:
        for row in table:
            print(json.dumps(row))
        return 0
    width = max(len(r["architecture"]) for r in table)
    print(f"{'architecture':<{width}}  {'family':<8}  presets")
    for r in table:
        print(f"{r['architecture']:<{width}}  {r['family']:<8}  {', '.join(r['presets']) or '-'}")
        print(f"{'':<{width}}  tested: {r['tested']}")
    print(f"\nevery family runs: {', '.join(table[0]['supports'])}; "
          "an architecture not listed is refused with this list (exit 2)")
    return 0
