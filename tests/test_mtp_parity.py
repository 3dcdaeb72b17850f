"""The MTP layer (models/mtp.py) equals its torch reference (tests/mtp_checkpoints.py, built
from transformers' DeepseekV3DecoderLayer / Glm4MoeDecoderLayer) in f32 within 1e-5: over a
whole sequence, and in two chunks whose second reads the first's MTP K/V from the paged
cache (NaN-filled elsewhere). The checkpoint with the MTP layer's embedding / head copies
and the one without load alike; without speculative.method = "mtp" the layer is skipped.
"""

import numpy as np
import pytest

from mtp_checkpoints import make_mtp_checkpoint, reference
from jaxfill.models.checkpoint import load_hf_params
from jaxfill.models.families.registry import config_from_hf
from jaxfill.models.kv_cache import KVCache, single_sequence_metadata

PAGE = 8
TOKENS = 29  # not a page multiple: the second chunk ends mid-page


def ours(model, config, tokens, split: int):
    """(hidden [T, E], MTP logits [T - 1, V]) through the paged cache, in chunks [0, split), [split, T)."""
    import dataclasses

    import jax.numpy as jnp

    cache = KVCache.create(config, num_pages=8, page_size=PAGE, fill_value=float("nan"))
    pages = list(range(1, 6))
    hs, logits = [], []
    for a, b in ((0, split), (split, len(tokens))) if split < len(tokens) else ((0, split),):
        meta = single_sequence_metadata(b - a, a, pages, PAGE)
        rows = jnp.arange(b - a, dtype=jnp.int32)
        tok = jnp.asarray(tokens[a:b], jnp.int32)
        pos = jnp.arange(a, b, dtype=jnp.int32)
        _, cache, h = model(tok, pos, cache, meta, hidden_rows=True)
        nxt = jnp.asarray(list(tokens[a + 1:b + 1]) + [0] * (b + 1 - len(tokens)), jnp.int32)  # last row: unused
        _, lg, cache = model.mtp_forward(h, nxt, pos, cache, dataclasses.replace(meta, logits_indices=rows))
        hs.append(np.asarray(h, np.float64))
        logits.append(np.asarray(lg, np.float64))
    return np.concatenate(hs), np.concatenate(logits)[:len(tokens) - 1]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return {copies: make_mtp_checkpoint(str(root / f"dsv3_{copies}"), copies=copies) for copies in (True, False)}


@pytest.mark.parametrize("copies", [True, False])
def test_deepseek_v3_mtp_logits_match_the_torch_reference(checkpoints, copies):
    directory, mtp = checkpoints[copies]
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
    directory, _ = checkpoints[True]
    model = load_hf_params(directory, config_from_hf(directory), attention_impl="xla", progress=False)
    assert not hasattr(model, "mtp")
