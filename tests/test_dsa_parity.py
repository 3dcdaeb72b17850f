"""DeepSeek sparse attention (DeepSeek V3.2, GLM-5) on the random-init HF checkpoints of
tests/hf_models.py (index_topk 16): f32 logits and greedy tokens equal to transformers'
are tests/test_moe_parity.py's (MOE_KWARGS deepseek_v32 and glm_moe_dsa: the top-k binds
on the 64- and 300-token prompts and through the greedy continuation; every prompt runs
in 64-row steps, so the indexer's keys of earlier steps come from the cache). Here: below
index_topk, or with index_topk past the prompt, the model is the dense MLA model on the
same weights, bit for bit; where it binds, dropping the selection or the indexer's rope
layout moves the logits far past the parity tolerance."""

import numpy as np
import pytest
from flax import nnx

from hf_models import make_hf_checkpoint
from jaxfill.models.checkpoint import load_hf_params
from jaxfill.models.families.registry import config_from_hf, new_model
from test_model_parity import ours_last_logits, prompts, rel_l2


def same_weights(loaded, config):
    """`config`'s model holding `loaded`'s weights (less the indexer's, if it has none)."""
    other = new_model(config, nnx.Rngs(0))
    weights = dict(nnx.to_flat_state(nnx.state(loaded)))
    for path, var in nnx.to_flat_state(nnx.state(other)):
        var.set_value(weights[path][...])
    return other


def test_below_index_topk_it_is_dense_mla(tmp_path):
    directory = make_hf_checkpoint(str(tmp_path / "v32"), "deepseek_v32")
    config = config_from_hf(directory)
    assert config.mla.index_topk == 16 and not config.mla.index_rope_interleave
    model = load_hf_params(directory, config, progress=False)
    m = config.mla
    dense_config = config.replace(index_topk=0, index_n_heads=0, index_head_dim=0,
                                  head_dim=m.kv_lora_rank + m.qk_rope_head_dim)
    dense = same_weights(model, dense_config)
    wide_config = config.replace(index_topk=512)  # every prompt below it
    wide = same_weights(model, wide_config)
    for length, tokens in prompts(config.vocab_size):
        want = ours_last_logits(dense, dense_config, tokens)
        # the dense branch of the step's lax.cond: DeepSeek V3's attention, compiled beside the
        # sparse branch. Bit for bit with XLA:CPU's fusion emitters; without them (tests/conftest.py)
        # the two programs round apart by ~1e-6, three orders under what selection moves (below)
        np.testing.assert_allclose(ours_last_logits(wide, wide_config, tokens), want, rtol=1e-5, atol=1e-5,
                                   err_msg=str(length))
        got = ours_last_logits(model, config, tokens)
        if length <= m.index_topk:  # every causal key selected: the same attention as DeepSeek V3's
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=str(length))
        else:  # the top 16 of 64 or 300 keys: far from dense (HF agrees with this one)
            assert rel_l2(got, want) > 1e-2, length


# The other rope layout of the indexer (V3.2 halves, GLM-5 interleaved pairs), with the
# loaded weights: the 300-token prompt's logits move by more than 1e-3 relative.
DSA_ABLATIONS = {"deepseek_v32-pairs": dict(index_rope_interleave=True),
                 "glm_moe_dsa-halves": dict(index_rope_interleave=False)}


@pytest.mark.parametrize("name", sorted(DSA_ABLATIONS))
def test_the_indexer_rope_layout_changes_the_logits(tmp_path, name):
    from test_family_parity import check_feature_changes_the_logits

    arch = name.split("-")[0]
    check_feature_changes_the_logits(make_hf_checkpoint(str(tmp_path / arch), arch), DSA_ABLATIONS[name], name)
