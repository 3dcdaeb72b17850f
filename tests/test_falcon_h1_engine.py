"""Falcon-H1 through the Engine: every layer holds KV pages and a state slot at once
(models/linear_state.PagesAndState). Every layout the capability table allows gives the
unchunked engine's tokens and logprobs: 16-token chunks, prefix-cached through state
snapshots (the second call resumes from the first's, so the slot copies must carry the
parallel layers' states), mesh.tensor = 2 (each rank half the attention heads, half the
Mamba2 groups' params and state); an int8 KV cache for the attention half stays close; the
unchunked engine's greedy tokens are HF generate's. Pages and slots all come back. One
subprocess on 2 fake CPU devices builds the five engines."""

import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="the Hugging Face reference needs torch (the test extra)")

from family_layouts import check_layouts, run_layouts
from hf_models import load_hf, make_hf_checkpoint

ARCH = "falcon_h1"
SNAPSHOTS = {"engine.state_snapshot_tokens": 32}
LAYOUTS = {
    "whole": {"engine.enable_prefix_caching": False},
    "chunked": {"engine.enable_prefix_caching": False, "engine.max_num_batched_tokens": 16,
                "engine.token_buckets": [16]},
    "prefix": SNAPSHOTS,
    "tensor2": {"mesh.tensor": 2, **SNAPSHOTS},
    "int8": {"engine.kv_cache_dtype": "int8", **SNAPSHOTS},  # the attention pages only: weights stay float
}


@pytest.fixture(scope="module")
def falcon(tmp_path_factory):
    return make_hf_checkpoint(str(tmp_path_factory.mktemp("falcon_engine") / ARCH), ARCH)


@pytest.mark.slow  # 32 s in a full run (2026-12-07, 2 loaded cores)
def test_layouts_agree(falcon):
    r = run_layouts(falcon, LAYOUTS, devices=2)
    check_layouts(r, ARCH, exact=("chunked", "prefix", "tensor2"))
    (_, heads, *rest), (_, channels, k) = r["whole"]["state_shard"]
    for name in LAYOUTS:
        split = 2 if name == "tensor2" else 1
        got = [shape[1:] for shape in r[name]["state_shard"]]
        assert got == [[heads // split, *rest], [channels // split, k]], (name, got)
    # the reference is HF's: its greedy continuations of the 100- and 3-token prompts
    # (tests/family_layouts.py SCRIPT draws them)
    rng = np.random.default_rng(5)
    long = [int(t) for t in rng.integers(3, 500, 100)]
    hf = load_hf(falcon)
    for prompt, want in ((long, r["whole"]["tokens"][0]), ([7, 9, 11], r["whole"]["tokens"][2])):
        with torch.no_grad():
            out = hf.generate(torch.tensor(prompt)[None], max_new_tokens=6, min_new_tokens=6, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == want
