"""Breaks a quantized checkpoint's safetensors one way at a time and checks the loader
names the tensor (tests/test_fp8_block.py, tests/test_int_group.py)."""

import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from jaxfill.models.checkpoint import CheckpointError, load_hf_params
from jaxfill.models.families.registry import config_from_hf


def assert_breaks_are_named(directory: str, name: str, changes: dict, tmp_path, match: str) -> None:
    """changes: {case: f(tensors) that removes or reshapes `name`}; each broken copy fails to
    load with a CheckpointError matching `match`."""
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    for case, change in changes.items():
        bad = str(tmp_path / case)
        shutil.copytree(directory, bad)
        broken = dict(tensors)
        change(broken)
        save_file({k: v.contiguous() for k, v in broken.items()}, os.path.join(bad, "model.safetensors"),
                  metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=match):
            load_hf_params(bad, config_from_hf(bad), progress=False)
