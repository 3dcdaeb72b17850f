"""DeepSeek sparse attention (V3.2, GLM-5) through the Engine (tests/family_layouts.py's check,
from the HF checkpoints of tests/hf_models.py, index_topk 16 under the 100- and 84-token
prompts): unchunked == chunks of 7 and 16 tokens (a chunk's indexer scores keys that
earlier chunks wrote into the latent cache entries) == prefix-cached (the indexer keys of
the shared pages come from the cache with the latent) == mesh.tensor=2 (the indexer
replicated, the heads split) == scanned layers == mesh.stage=2; an int8 cache (the
indexer key quantized with the latent) stays close. mesh.sequence is refused for the
kind (engine/capabilities/table.py). One subprocess per model on 2 fake CPU devices."""

import pytest
from family_layouts import LAYOUTS, check_layouts, run_layouts
from hf_models import make_hf_checkpoint


def chunks(n: int) -> dict:
    return {"engine.enable_prefix_caching": False, "engine.max_num_batched_tokens": n, "engine.token_buckets": [n]}


@pytest.mark.slow  # 79 s in a full run (2026-12-07, 2 loaded cores)
def test_deepseek_v32_layouts(tmp_path):
    """Dense MLPs only (stacked layouts hold one layer kind), two layers for two stages."""
    model = make_hf_checkpoint(str(tmp_path / "v32"), "deepseek_v32", num_hidden_layers=2, first_k_dense_replace=2)
    layouts = {"whole": LAYOUTS["whole"], "chunk7": chunks(7), "chunk16": chunks(16), "prefix": LAYOUTS["prefix"],
               "tensor2": {"mesh.tensor": 2}, "scan": LAYOUTS["scan"], "stage2": LAYOUTS["stage2"],
               "int8": {"engine.kv_cache_dtype": "int8"}}
    r = run_layouts(model, layouts, devices=2)
    check_layouts(r, "deepseek_v32", ("chunk7", "chunk16", "prefix", "tensor2", "scan", "stage2"))
    # a token's entry: latent 32 + roped key 16 + indexer key 32, f32, in each of 2 layers
    assert r["whole"]["kv_bytes_per_token"] == 2 * (32 + 16 + 32) * 4


@pytest.mark.slow  # 54 s in a full run (2026-12-07, 2 loaded cores)
def test_glm_moe_dsa_layouts(tmp_path):
    """A dense layer, then two with experts (each expert's routed pairs counted alike)."""
    model = make_hf_checkpoint(str(tmp_path / "glm5"), "glm_moe_dsa")
    layouts = {"whole": LAYOUTS["whole"], "chunk16": chunks(16), "prefix": LAYOUTS["prefix"],
               "tensor2": {"mesh.tensor": 2}}
    check_layouts(run_layouts(model, layouts, devices=2), "glm_moe_dsa", ("chunk16", "prefix", "tensor2"))
