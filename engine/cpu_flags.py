"""XLA:CPU flags the engine sets before jax's CPU backend starts.

`--xla_cpu_experimental_ynn_fusion_type=` (no YNNPACK fusions). jaxlib 0.10.2 and 0.11.2
hand dots and their neighbours to YNNPACK fusions by default, and loading such an
executable from the persistent compile cache is quadratic: perf shows 54% of it in
`YnnFusionThunkFromProto`, 42% in `HloInstruction::unique_id` (each fusion looks its
instruction up by walking the module). SmolLM2-135M's 24.8 MB step program took 19.8-20.0 s
to deserialize with them and 8.2-8.3 s without (same window, 2026-12-07), about half of a
warm `generate`. Without them the same model's decode step and 512-token prefill used no
more CPU time (prefill 12% less; benchmarks/RESULTS.md, "YNNPACK fusions on XLA:CPU").

A bfloat16 model keeps them: YNNPACK's dots are what run bf16 at the CPU's avx512_bf16 rate.
Without them a bf16 dot runs at the f32 rate (2048x512x1408 on one core, jaxlib 0.10.2 and
0.11.2: bf16 85-187 GFLOP/s with them, 40-53 without, f32 43-105 either way; loaded machine,
benchmarks/bf16_dot_versions.py and RESULTS.md "bf16 dots"). End to end the bench shape's bf16
prefill gained 8-10% at 512 tokens and nothing clear at 2048, for a slower warm start; the
default float32 model gains nothing from them.

Only jaxlib versions known to have the flag get it (XLA aborts the process on an unknown
flag), only when XLA_FLAGS does not name it already (the user's choice wins), and only
before the backend starts (XLA reads XLA_FLAGS then, once).
"""

from __future__ import annotations

import os

YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type"
FLAG_VERSIONS = ("0.10.", "0.11.")  # jaxlib versions read to have YNN_FLAG (their .so's flag list)


def set_cpu_xla_flags(dtype: str = "float32") -> bool:
    """Adds YNN_FLAG= to XLA_FLAGS unless it is there, this jaxlib lacks it or the model
    computes in bfloat16 (`dtype`, model.dtype); True when it did. Call before jax's backends
    start (engine/cpu_devices.py use_cpu_cores does)."""
    import jaxlib

    flags = os.environ.get("XLA_FLAGS", "")
    if YNN_FLAG in flags or not jaxlib.__version__.startswith(FLAG_VERSIONS) or dtype == "bfloat16":
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {YNN_FLAG}=".strip()
    return True
