"""The Qwen3.5 / Qwen3.5-MoE / Qwen3-Next MTP block (`mtp.*`, models/families/qwen_mtp_tensors.py
run by models/mtp.py) equals its torch reference (tests/qwen_mtp_checkpoints.py: transformers'
own decoder layer as a full-attention layer, with the published pre-fc norms, fc and final
norm around it) in f32 (relative L2 within 1e-5, each logit within 5e-5): over a whole sequence, and in two chunks whose second
reads the first's MTP K/V from the paged cache and the target's recurrent state from its
slot (NaN-filled elsewhere). Without speculative.method = "mtp" the block is skipped; a
checkpoint with its own MTP embedding, or with the block stripped, is refused by name.
"""

import json
import os

import numpy as np
import pytest

from mtp_checkpoints import reference
from qwen_mtp_checkpoints import make_qwen_mtp_checkpoint
from test_model_parity import rel_l2
from test_mtp_parity import TOKENS, ours
from jaxfill.models.checkpoint import load_hf_params
from jaxfill.models.config import ConfigError
from jaxfill.models.families.registry import config_from_hf
from jaxfill.models.safetensors_file import CheckpointError

ARCHS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_mtp")
    return {arch: make_qwen_mtp_checkpoint(str(root / arch), arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_logits_match_the_torch_reference(checkpoints, arch):
    """Dense (Qwen3.5) and sparse (Qwen3.5-MoE, Qwen3-Next: routed experts + gated shared
    expert) MTP layers, gated attention with a quarter of each head roped."""
    directory, mtp = checkpoints[arch]
    config = config_from_hf(directory)
    assert config.mtp_layers == 1 and config.num_layers not in config.linear.layers
    config = config.replace(run_mtp=True)
    model = load_hf_params(directory, config, attention_impl="xla", progress=False)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, TOKENS)
    ref_h, ref_logits = reference(mtp, tokens)
    for split in (TOKENS, 11):
        h, logits = ours(model, config, tokens, split)
        # the target's chunked delta rule sums in another order than transformers' (a few of
        # its hidden values differ by ~1e-5, as tests/test_hybrid_parity.py bounds them: rel L2)
        for got, want in ((h, ref_h), (logits, ref_logits)):
            assert rel_l2(got, want) <= 1e-5, (split, rel_l2(got, want))
            np.testing.assert_allclose(got, want, atol=5e-5, rtol=1e-5)
    assert np.abs(ref_logits).max() > 0.1  # not a vanishing head that any layer would match


def test_without_mtp_the_block_is_skipped(checkpoints):
    directory, _ = checkpoints["qwen3_5"]
    model = load_hf_params(directory, config_from_hf(directory), attention_impl="xla", progress=False)
    assert not hasattr(model, "mtp")


def test_dedicated_embeddings_and_stripped_blocks_are_refused(checkpoints, tmp_path):
    """mtp_use_dedicated_embeddings (an MTP embedding of its own, not read) and a config
    that declares the block over a file without it: each refused by name at load."""
    from safetensors.torch import load_file, save_file

    src, _ = checkpoints["qwen3_5"]
    for case in ("dedicated", "stripped"):
        directory = str(tmp_path / case)
        os.makedirs(directory)
        with open(os.path.join(src, "config.json")) as f:
            hf = json.load(f)
        tensors = load_file(os.path.join(src, "model.safetensors"))
        if case == "dedicated":
            hf["mtp_use_dedicated_embeddings"] = True
        else:
            tensors = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(hf, f)
        save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        config = config_from_hf(directory).replace(run_mtp=True)
        error, match = (ConfigError, "mtp_use_dedicated_embeddings") if case == "dedicated" else (
            CheckpointError, "no multi-token-prediction layer")
        with pytest.raises(error, match=match):
            load_hf_params(directory, config, attention_impl="xla", progress=False)
