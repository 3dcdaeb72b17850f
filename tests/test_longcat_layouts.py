"""LongCat-Flash through the Engine (tests/family_layouts.py's run, from the HF checkpoint of
tests/hf_models.py): unchunked == chunks of 7 == prefix-cached == mesh.tensor=4 ==
mesh.expert=4 == expert 2 x tensor 2 (4 fake CPU devices), tokens, logprobs and each
expert's routed pairs alike. The zero-compute experts hold no weights and run where the
token is (models/moe.py identity_experts), so under every expert split their pairs are
dropped from the dispatch and from the counts: a layer counts at most top_k pairs a row."""

import pytest
import numpy as np

from family_layouts import LAYOUTS, run_layouts
from hf_models import make_hf_checkpoint

CHUNK7 = {"engine.enable_prefix_caching": False, "engine.max_num_batched_tokens": 7, "engine.token_buckets": [7]}
EXACT = ("chunk7", "prefix", "tensor4", "expert4", "expert2_tensor2")


@pytest.mark.slow  # 31 s in a full run (2026-12-07, 2 loaded cores)
def test_longcat_layouts(tmp_path):
    model = make_hf_checkpoint(str(tmp_path / "longcat"), "longcat_flash")
    layouts = {"whole": LAYOUTS["whole"], "chunk7": CHUNK7, "prefix": LAYOUTS["prefix"],
               "tensor4": {"mesh.tensor": 4}, "expert4": {"mesh.expert": 4},
               "expert2_tensor2": {"mesh.expert": 2, "mesh.tensor": 2}}
    r = run_layouts(model, layouts, devices=4)
    want = r["whole"]
    assert len({tuple(t) for t in want["tokens"]}) == 3 and want["cached"] == [0, 0, 0]
    assert r["prefix"]["cached"][1] >= 64
    assert set(want["experts"]) == {"0", "2"}  # the MoE sits in the even layers
    for name in EXACT:
        got = r[name]
        assert got["tokens"] == want["tokens"], name
        np.testing.assert_allclose(got["logprob"], want["logprob"], atol=2e-4, err_msg=name)
        assert got["pages_back"], name
        for layer, counts in got["experts"].items():
            # zero-compute pairs are never counted: fewer than top_k a row, but some real ones
            assert 0 < sum(counts) < got["top_k"] * got["rows"], (name, layer, sum(counts))
            if got["rows"] == want["rows"]:
                assert counts == want["experts"][layer], (name, layer)
