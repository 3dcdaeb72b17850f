"""The override the suite's engine tests start from: the `reference` attention impl.

Those tests compare an engine with itself (chunked, cached, sharded, moved, preempted...),
not attention numerics: the HF parity tests run every family through `xla`, and
tests/test_attention_oracle.py checks every impl against float64. On XLA:CPU the
reference's step program compiles several times faster than xla's blocked loops
(tiny_random: 3.1 -> 0.8 s; tests/test_mla_layouts.py 104 -> 35 CPU-s), and compiling is
most of what these tests cost. Tests of a user's path (the CLI, the first hour, the real
checkpoints, quantized KV, bf16 pages, the `jaxfill serve` subprocess tests) keep `auto`."""

REFERENCE_ATTENTION = {"engine.attention_impl": "reference"}
