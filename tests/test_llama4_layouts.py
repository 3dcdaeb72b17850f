"""Llama 4 through the Engine on 4 fake CPU devices (tests/family_layouts.py's prompts of
100, 84 and 3 tokens, chunks of 32 positions): whole == chunked prefill (16-token steps
crossing the chunk boundaries) == prefix-cached (the 84-token prompt resumes at 72, inside
a chunk) == expert 4 == expert 2 x tensor 2 == expert 2 x sequence 2; int8 weights and KV
stay close. Two layers: a chunked, roped sparse layer and a global NoPE dense one."""

from family_layouts import LAYOUTS, check_layouts, run_layouts
from hf_models import make_hf_checkpoint

LLAMA4_LAYOUTS = {**{name: LAYOUTS[name] for name in ("whole", "chunked", "prefix", "int8")},
                  "expert4": {"mesh.expert": 4},
                  "expert2_tensor2": {"mesh.expert": 2, "mesh.tensor": 2},
                  "expert2_sequence2": {"mesh.expert": 2, "mesh.sequence": 2}}


def test_llama4_layouts(tmp_path):
    model = make_hf_checkpoint(str(tmp_path / "llama4"), "llama4", num_hidden_layers=2, moe_layers=[0])
    results = run_layouts(model, LLAMA4_LAYOUTS, devices=4)
    check_layouts(results, "llama4", ("chunked", "prefix", "expert4", "expert2_tensor2", "expert2_sequence2"))
