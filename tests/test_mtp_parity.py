"""The MTP layer (models/mtp.py) equals its torch reference (tests/mtp_checkpoints.py, built
from transformers' DeepseekV3DecoderLayer / Glm4MoeDecoderLayer) in f32 within 1e-5: over a
whole sequence, and in two chunks whose second reads the first's MTP K/V from the paged
cache (NaN-filled elsewhere). The checkpoint with the MTP layer's embedding / head copies
and the one without load alike; without speculative.method = "mtp" the layer is skipped.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp_checkpoints import make_mtp_checkpoint, reference
from jaxfill.models.checkpoint import load_hf_params
from jaxfill.models.families.registry import config_from_hf
from jaxfill.models.kv_cache import KVCache, single_sequence_metadata

PAGE = 8
TOKENS = 29  # not a page multiple: the second chunk ends mid-page


PAD = 32  # every chunk padded to one shape: one compiled program per model


@functools.partial(jax.jit, static_argnums=0)
def target_then_mtp(graphdef, state, tokens, positions, cache, meta, following):
    model = nnx.merge(graphdef, state)
    rows = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    _, cache, h = model(tokens, positions, cache, meta, hidden_rows=True)
    _, logits, cache = model.mtp_forward(h, following, positions, cache,
                                         dataclasses.replace(meta, logits_indices=rows))
    return h, logits, cache


def ours(model, config, tokens, split: int):
    """(hidden [T, E], MTP logits [T - 1, V]) through the paged cache, in chunks [0, split), [split, T)."""
    graphdef, state = nnx.split(model)
    cache = KVCache.create(config, num_pages=8, page_size=PAGE, fill_value=float("nan"))
    pages = list(range(1, 6))
    hs, logits = [], []
    for a, b in ((0, split), (split, len(tokens))) if split < len(tokens) else ((0, split),):
        meta = single_sequence_metadata(b - a, a, pages, PAGE, pad_to=PAD)
        pad = PAD - (b - a)
        tok = jnp.asarray(list(tokens[a:b]) + [0] * pad, jnp.int32)
        pos = jnp.asarray(list(range(a, b)) + [0] * pad, jnp.int32)
        nxt = jnp.asarray(list(tokens[a + 1:b + 1]) + [0] * (PAD - len(tokens[a + 1:b + 1])), jnp.int32)
        h, lg, cache = target_then_mtp(graphdef, state, tok, pos, cache, meta, nxt)
        hs.append(np.asarray(h, np.float64)[:b - a])
        logits.append(np.asarray(lg, np.float64)[:b - a])
    return np.concatenate(hs), np.concatenate(logits)[:len(tokens) - 1]


CASES = {"deepseek_v3": ("deepseek_v3", True), "deepseek_v3_no_copies": ("deepseek_v3", False),
         "glm4_moe": ("glm4_moe", True)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return {name: make_mtp_checkpoint(str(root / name), arch, copies=copies) for name, (arch, copies) in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_mtp_logits_match_the_torch_reference(checkpoints, case):
    """DeepSeek-V3 (MLA + MoE) with and without the MTP layer's embedding / head copies in the
    file; GLM-4.5 (q/k/v biases, qk norms, partial rope + MoE)."""
    directory, mtp = checkpoints[case]
    config = config_from_hf(directory)
    assert config.mtp_layers == 1
    config = config.replace(run_mtp=True)
    model = load_hf_params(directory, config, attention_impl="xla", progress=False)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, TOKENS)
    ref_h, ref_logits = reference(mtp, tokens)
    for split in (TOKENS, 11):
        h, logits = ours(model, config, tokens, split)
        np.testing.assert_allclose(h, ref_h, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert np.abs(ref_logits).max() > 0.1  # not a vanishing head that any layer would match


def test_without_mtp_the_layer_is_skipped(checkpoints):
    directory, _ = checkpoints["deepseek_v3"]
    model = load_hf_params(directory, config_from_hf(directory), attention_impl="xla", progress=False)
    assert not hasattr(model, "mtp")
