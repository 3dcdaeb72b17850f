"""`jaxfill models`: each architecture, its family and kinds, and what runs on it: the
capability matrix of engine/capabilities/support_matrix.py (tested / untested / refused per capability,
the test behind each tested cell), and which presets carry its published shapes."""

from __future__ import annotations

import json

COMMAND = ("models",)
HELP = "list the supported architectures and what runs on each (tested, untested, refused)"


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object per architecture on stdout")


def run(args) -> int:
    from jaxfill.engine.capabilities.support_matrix import COLUMNS, SHORT, rows

    table = rows()
    if args.json:
        for row in table:
            print(json.dumps(row))
        return 0
    width = max(len(r["architecture"]) for r in table)
    mark = {"tested": "yes", "untested": "?", "refused": "no"}
    widths = [max(len(SHORT[c]), 3) for c in COLUMNS]
    print(f"{'architecture':<{width}}  " + "  ".join(f"{SHORT[c]:<{w}}" for c, w in zip(COLUMNS, widths))
          + "  presets")
    for r in table:
        cells = "  ".join(f"{mark[r['supports'][c]]:<{w}}" for c, w in zip(COLUMNS, widths))
        print(f"{r['architecture']:<{width}}  {cells}  {', '.join(r['presets']) or '-'}")
    print("\nyes: tested against a reference (the test: jaxfill models --json); ?: accepted, no test runs it; "
          "no: refused at config time (the reason: --json or docs/capabilities.md). "
          "An architecture not listed is refused (exit 2).")
    return 0
