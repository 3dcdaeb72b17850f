"""Linear-attention hybrids (Qwen3.5, Qwen3-Next) through the Engine in every layout they
support, one subprocess per model on 2 fake CPU devices (tests/family_layouts.py):
unchunked == 16-token chunks == prefix-cached through state snapshots every 32 tokens ==
mesh.tensor = 2 (each rank one key-head group's params and state) with snapshots too:
the same greedy tokens and first logprobs, every page back."""

import pytest

from family_layouts import check_every_layout
from hf_models import make_hf_checkpoint

SNAPSHOTS = {"engine.state_snapshot_tokens": 32}
LAYOUTS = {
    "whole": {"engine.enable_prefix_caching": False},
    "chunked": {"engine.enable_prefix_caching": False, "engine.max_num_batched_tokens": 16,
                "engine.token_buckets": [16]},
    "prefix": SNAPSHOTS,
    "tensor2": {"mesh.tensor": 2, **SNAPSHOTS},
    "tensor2_chunked": {"mesh.tensor": 2, "engine.max_num_batched_tokens": 16, "engine.token_buckets": [16],
                        **SNAPSHOTS},
}


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_hybrid_layouts_agree(tmp_path, arch):
    directory = make_hf_checkpoint(str(tmp_path / arch), arch)
    check_every_layout(directory, arch, LAYOUTS, exact=tuple(n for n in LAYOUTS if n != "whole"))
