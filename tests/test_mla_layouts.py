"""DeepSeek V3's multi-head latent attention through the Engine (tests/family_layouts.py's
check, from the HF checkpoints of tests/hf_models.py): unchunked == chunks of 1, 7, 16
and 64 tokens == prefix-cached (vLLM had MLA wrong under chunked prefill: vllm#26042)
== mesh.tensor=2 (the latent replicated, the heads split) == mesh.sequence=2 == scanned
layers == mesh.stage=2 == expert 2 x tensor 2 for the
MoE model == the absorbed or the expanded form forced on every step; an int8 latent
cache stays close. One subprocess per model, on 2 and 4 fake
CPU devices."""

import pytest
from family_layouts import LAYOUTS, check_layouts, run_layouts
from hf_models import make_hf_checkpoint


def chunks(n: int) -> dict:
    return {"engine.enable_prefix_caching": False, "engine.max_num_batched_tokens": n, "engine.token_buckets": [n]}


COMMON = {"whole": LAYOUTS["whole"], "chunk1": chunks(1), "chunk7": chunks(7), "chunk16": chunks(16),
          "chunk64": chunks(64), "prefix": LAYOUTS["prefix"], "tensor2": {"mesh.tensor": 2},
          "sequence2": LAYOUTS["sequence2"], "scan": LAYOUTS["scan"], "stage2": LAYOUTS["stage2"],
          "int8": {"engine.kv_cache_dtype": "int8"},
          # each form forced on every step (auto picks per step: models/mixers/mla_expanded.py)
          "absorbed": {**chunks(16), "model.mla_form": "absorbed"},
          "expanded": {**chunks(16), "model.mla_form": "expanded"}}
EXACT = ("chunk1", "chunk7", "chunk16", "chunk64", "prefix", "tensor2", "sequence2", "scan", "stage2",
         "absorbed", "expanded")


@pytest.mark.slow  # 64 s in a full run (2026-12-07, 2 loaded cores)
def test_dense_mla(tmp_path):
    """q straight from the hidden state, plain rope, every layer dense."""
    model = make_hf_checkpoint(str(tmp_path / "dense"), "deepseek_v3_dense")
    r = run_layouts(model, COMMON, devices=2)
    check_layouts(r, "deepseek_v3_dense", EXACT)
    # the cache holds the latent once: layers x (kv_lora_rank + qk_rope_head_dim) x 4 bytes (f32)
    assert r["whole"]["kv_bytes_per_token"] == 2 * (32 + 16) * 4


@pytest.mark.slow  # 34 s in a full run (2026-12-07, 2 loaded cores)
def test_mla_with_experts(tmp_path):
    """Low-rank q, YaRN with the mscale correction, a dense layer then grouped sigmoid
    routing with a shared expert, split over experts and heads."""
    model = make_hf_checkpoint(str(tmp_path / "moe"), "deepseek_v3", num_hidden_layers=2)
    layouts = {name: COMMON[name] for name in ("whole", "chunk7", "prefix", "int8")}
    layouts["expert2_tensor2"] = {"mesh.expert": 2, "mesh.tensor": 2}
    check_layouts(run_layouts(model, layouts, devices=4), "deepseek_v3", ("chunk7", "prefix", "expert2_tensor2"))
