import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/hf_models.py and friends


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    """Random-init HF checkpoints, f32, written once per session: {"llama": dir, ...}."""
    from hf_models import make_hf_checkpoint

    root = tmp_path_factory.mktemp("hf")
    return {arch: make_hf_checkpoint(str(root / arch), arch) for arch in ("llama", "mistral", "qwen2")}
