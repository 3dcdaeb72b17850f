"""LongCat-Flash against transformers (models/families/longcat.py, models/shortcut_decoder.py):
f32 last-row logits within 1e-5 and greedy tokens on a random-init checkpoint
(tests/hf_models.py MOE_KWARGS: non-zero correction bias, routed scaling 1.7, 4 zero-compute
experts beside 8 that real tokens are routed to), and each LongCat feature moves the logits."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Hugging Face reference needs torch (the test extra)")

from hf_models import load_hf, make_hf_checkpoint
from jaxfill.models.checkpoint import load_hf_params
from jaxfill.models.families.registry import config_from_hf, param_count
from test_family_parity import check_feature_changes_the_logits
from test_model_parity import check_greedy_matches_hf, hf_last_logits, ours_last_logits, prompts, rel_l2


@pytest.fixture(scope="module")
def longcat_dir(tmp_path_factory):
    return make_hf_checkpoint(str(tmp_path_factory.mktemp("hf") / "longcat_flash"), "longcat_flash")


def zero_expert_share(hf, tokens) -> float:
    """The share of HF's (token, expert) choices that go to a zero-compute expert."""
    chosen = []
    routers = [layer.mlp.router for layer in hf.model.layers]
    hooks = [r.register_forward_hook(lambda m, i, out: chosen.append(out[2])) for r in routers]
    with torch.no_grad():
        hf(torch.tensor(tokens)[None])
    for h in hooks:
        h.remove()
    ids = torch.cat([c.reshape(-1) for c in chosen])
    return float((ids >= hf.config.n_routed_experts).float().mean())


def test_f32_logits_and_greedy_tokens_match_hf(longcat_dir):
    config = config_from_hf(longcat_dir)
    assert config.num_layers == 4 and config.moe.zero_experts == 4 and config.moe.routed_scaling == 1.7
    model = load_hf_params(longcat_dir, config, progress=False)
    hf = load_hf(longcat_dir)
    buffers = sum(b.numel() for name, b in hf.named_buffers() if name.endswith("correction_bias"))
    assert param_count(config) == sum(p.numel() for p in hf.parameters()) + buffers
    for length, tokens in prompts(config.vocab_size):
        share = zero_expert_share(hf, tokens)
        assert 0.05 < share < 0.95, (length, share)  # both kinds of expert get real tokens
        err = rel_l2(ours_last_logits(model, config, tokens), hf_last_logits(hf, tokens))
        assert err <= 1e-5, (length, err)
    check_greedy_matches_hf(model, config, hf, 16)


LONGCAT_ABLATIONS = {
    "latent-scale": dict(mla_latent_scale=1.0),
    "routed-scaling": dict(routed_scaling=1.0),
    "correction-bias": dict(router_bias=False),
}


@pytest.mark.parametrize("name", sorted(LONGCAT_ABLATIONS))
def test_each_longcat_feature_changes_the_logits(longcat_dir, name):
    check_feature_changes_the_logits(longcat_dir, LONGCAT_ABLATIONS[name], name)


def test_zero_compute_experts_return_the_token_times_their_weight():
    """A token routed only to zero-compute experts comes out as itself times its weights."""
    import jax.numpy as jnp

    from jaxfill.models.moe import identity_experts

    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 8)), jnp.float32)
    weights = jnp.asarray([[0.5, 0.25], [0.1, 0.2], [0.3, 0.4]], jnp.float32)
    ids = jnp.asarray([[4, 5], [0, 6], [1, 2]], jnp.int32)
    out = np.asarray(identity_experts(x, weights, ids, num_experts=4))
    np.testing.assert_allclose(out, np.asarray(x) * np.asarray([[0.75], [0.2], [0.0]]), rtol=1e-6)
