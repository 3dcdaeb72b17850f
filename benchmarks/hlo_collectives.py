"""Collectives in compiled HLO text: how many of each kind and how many bytes they move.

Used by benchmarks/sharding.py and tests/test_sharding.py (which puts benchmarks/ on
sys.path); nothing in the package needs it.
"""

from __future__ import annotations

import re

import numpy as np

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_DTYPE_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s64": 8, "s32": 4, "u32": 4, "s16": 2,
                "u16": 2, "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")


def collective_ops(hlo_text: str) -> dict[str, int]:
    """Counts collectives in compiled HLO text (an async *-start counts once, *-done not),
    plus '<op>_bytes': the summed operand sizes of each kind, from the result shape and the
    replica-group size (compiled HLO text does not print operand types)."""
    counts = {op: 0 for op in COLLECTIVES}
    counts.update({op + "_bytes": 0 for op in COLLECTIVES})
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if not m:
            continue
        shapes, op, start = m.group(1), m.group(2), m.group(3)
        counts[op] += 1
        sizes = [int(np.prod([int(x) for x in dims.split(",") if x])) * _DTYPE_BYTES.get(dtype, 4)
                 for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shapes)]
        group = _group_size(line)
        if start and op in ("all-gather", "collective-permute", "all-to-all") and len(sizes) >= 2:
            nbytes = sizes[0]  # (operand, result[, ...]) tuple of the async start
        elif op == "all-gather":
            nbytes = sum(sizes) // group
        elif op == "reduce-scatter":
            nbytes = sum(sizes) * group
        else:
            nbytes = sum(sizes)
        counts[op + "_bytes"] += nbytes
    return counts


def _group_size(line: str) -> int:
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    return 1
