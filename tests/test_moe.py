"""The MoE layer's parts against float64 NumPy: routing (softmax top-k with and without
renormalisation; sigmoid scores with a correction bias and grouped top-k), the grouped
experts of one rank (pairs of other ranks' experts sorted past the groups, NaN in their
token rows), an expert with no token and every token on one expert, int8 experts."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxfill.models.config import ConfigError, ModelConfig
from jaxfill.models.moe import MoE, grouped_experts, route
from jaxfill.models.quant import dequantize

MOE = ModelConfig.of(hidden_size=32, num_experts=8, experts_per_token=2, moe_intermediate_size=16)


def silu(x):
    return x / (1 + np.exp(-x))


def np_route(logits, config, bias=None):  # [T, E] f64 -> weights [T, k], ids [T, k]
    k = config.moe.experts_per_token
    if config.moe.scoring == "softmax":
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
        choice = scores
    else:
        scores = 1 / (1 + np.exp(-logits))
        choice = scores + (0 if bias is None else bias)
        g = config.moe.groups
        if g > 1:
            t, e = choice.shape
            groups = np.sort(choice.reshape(t, g, e // g), -1)[..., -2:].sum(-1)
            keep = np.argsort(-groups, -1, kind="stable")[:, :config.moe.topk_groups]
            mask = np.zeros((t, g), bool)
            np.put_along_axis(mask, keep, True, 1)
            choice = np.where(np.repeat(mask, e // g, 1), choice, -np.inf)
    ids = np.argsort(-choice, -1, kind="stable")[:, :k]
    weights = np.take_along_axis(scores, ids, 1)
    if config.moe.renormalize:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights * config.moe.routed_scaling, ids


def np_experts(x, weights, ids, gate_up, down):  # the dense definition: sum_k w_k * expert_k(x)
    out = np.zeros((x.shape[0], down.shape[-1]))
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], ids[t]):
            h = x[t] @ gate_up[e].reshape(x.shape[1], -1)
            g, u = np.split(h, 2)
            out[t] += w * ((silu(g) * u) @ down[e])
    return out


ROUTERS = {
    "softmax-renorm": {},
    "softmax-plain": dict(router_renormalize=False),
    "sigmoid-grouped": dict(router_scoring="sigmoid", router_groups=4, router_topk_groups=2, routed_scaling=2.5,
                            experts_per_token=3),
    "sigmoid-flat": dict(router_scoring="sigmoid", routed_scaling=1.5, experts_per_token=3),
}


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_routing_matches_numpy(name):
    config = MOE.replace(**ROUTERS[name])
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((64, 8)).astype(np.float32)
    # every other expert's choice score below 0: picking 3 from 2 groups of 2 must take one
    # of them over the experts of the groups left out
    bias = np.where(np.arange(8) % 2 == 0, -2.0, 0.1 * rng.standard_normal(8)).astype(np.float32)
    use_bias = bias if config.moe.scoring == "sigmoid" else None
    w, ids = route(jnp.asarray(logits), config, None if use_bias is None else jnp.asarray(use_bias))
    want_w, want_ids = np_route(logits.astype(np.float64), config, use_bias)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-6)
    if config.moe.groups > 1:  # the chosen experts lie in at most topk_groups groups
        assert max(len(set(row // 2)) for row in np.asarray(ids)) <= config.moe.topk_groups


def test_router_settings_are_checked():
    with pytest.raises(ConfigError, match="router_groups"):
        MOE.replace(router_groups=3)
    with pytest.raises(ConfigError, match="experts_per_token"):
        MOE.replace(experts_per_token=9)
    with pytest.raises(ConfigError, match="sigmoid or softmax"):  # groups of softmax probabilities: Mistral 4
        MOE.replace(router_groups=2, router_scoring="topk_softmax")
    with pytest.raises(ConfigError, match="fewer than experts_per_token"):
        MOE.replace(router_groups=4, router_topk_groups=1, experts_per_token=3)


@pytest.mark.parametrize("first", [0, 2, 6])
def test_one_ranks_grouped_experts_match_the_dense_definition(first):
    """Rank `first // 2` of 4 holds experts [first, first + 2): its share of the output
    is the dense definition over its own experts only; tokens routed only elsewhere hold
    NaN and give exact zeros, as do the rows past the groups."""
    rng = np.random.default_rng(1)
    t, h, i, k, n_local = 40, 16, 8, 2, 2
    x = rng.standard_normal((t, h)).astype(np.float32)
    ids = np.stack([rng.permutation(8)[:k] for _ in range(t)]).astype(np.int32)
    weights = rng.random((t, k)).astype(np.float32)
    elsewhere = [n for n in range(t) if not any(first <= e < first + n_local for e in ids[n])]
    assert elsewhere and len(elsewhere) < t
    x[elsewhere] = np.nan
    gate_up = rng.standard_normal((8, h, 2, i)).astype(np.float32)
    down = rng.standard_normal((8, i, h)).astype(np.float32)
    local_params = {"gate_up": jnp.asarray(gate_up[first:first + n_local]),
                    "down": jnp.asarray(down[first:first + n_local])}
    got = grouped_experts(jnp.asarray(x), jnp.asarray(weights), jnp.asarray(ids), local_params, first, "silu")
    local = (ids >= first) & (ids < first + n_local)
    want = np_experts(np.nan_to_num(x).astype(np.float64), np.where(local, weights, 0.0), ids, gate_up, down)
    got = np.asarray(got)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[elsewhere], 0.0)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def _moe(config, router_rows=None):
    layer = MoE(config, nnx.Rngs(3))
    if router_rows is not None:  # steer every token to the given experts
        w = np.zeros((config.hidden_size, config.moe.num_experts), np.float32)
        for rank, e in enumerate(router_rows):
            w[:, e] = 10.0 - rank
        layer.router.set_value(jnp.asarray(w))
    return layer


def _reference(layer, config, x):
    logits = x @ np.asarray(layer.router[...], np.float64)
    w, ids = np_route(logits, config)
    gate_up, down = (np.asarray(p[...], np.float64) for p in (layer.experts_gate_up, layer.experts_down))
    if config.weight_dtype == "int8":
        gate_up = dequantize(np.asarray(layer.experts_gate_up[...]),
                             np.asarray(layer.experts_gate_up_scale[...])[:, None], np.float64)
        down = dequantize(np.asarray(layer.experts_down[...]), np.asarray(layer.experts_down_scale[...])[:, None],
                          np.float64)
    return np_experts(x, w, ids, gate_up, down), ids


@pytest.mark.parametrize("steer", [None, (3, 5)], ids=["random", "all-to-two"])
def test_layer_matches_numpy_with_idle_experts(steer):
    """All tokens on experts 3 and 5 (six experts idle), and a random router."""
    rng = np.random.default_rng(2)
    x = np.abs(rng.standard_normal((24, MOE.hidden_size))).astype(np.float32) + 0.1
    layer = _moe(MOE, steer)
    want, ids = _reference(layer, MOE, x.astype(np.float64))
    if steer:
        assert set(ids.ravel()) == set(steer)
    valid = np.arange(len(x)) % 5 != 3  # rows of padding tokens are computed but not counted
    got, counts = jax.jit(lambda m, x, v: m(x, v))(layer, jnp.asarray(x), jnp.asarray(valid))
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(counts), np.bincount(ids[valid].ravel(), minlength=MOE.moe.num_experts))


def test_int8_experts_match_their_dequantized_weights():
    config = MOE.replace(weight_dtype="int8")
    layer = _moe(config)
    assert layer.experts_gate_up[...].dtype == jnp.int8 and layer.experts_gate_up_scale[...].shape == (8, 2, 16)
    x = np.random.default_rng(4).standard_normal((16, config.hidden_size)).astype(np.float32)
    want, _ = _reference(layer, config, x.astype(np.float64))
    got, counts = layer(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-4, atol=1e-6)
    assert int(np.asarray(counts).sum()) == len(x) * config.moe.experts_per_token


def test_stacked_layouts_take_a_mixed_model_only_when_the_groups_match():
    from jaxfill.engine.config import load_config

    moe = {"model.num_experts": 8, "model.experts_per_token": 2, "model.moe_intermediate_size": 64}
    with pytest.raises(ConfigError, match="dense layers"):
        load_config("tiny_random", {**moe, "model.dense_layers": [1], "mesh.stage": 2})
    with pytest.raises(ConfigError, match="dense layers"):
        load_config("tiny_random", {**moe, "model.dense_layers": [0], "engine.scan_layers": True})
    # layers 1 and 3 dense: layer j of both stages has one kind
    assert load_config("tiny_random", {**moe, "model.dense_layers": [1, 3], "mesh.stage": 2}).mesh.stage == 2


def test_mesh_expert_needs_experts_it_can_split():
    """Refused at load_config: by the capability table (a dense model) and the shape check."""
    from jaxfill.engine.config import load_config

    with pytest.raises(ValueError, match="has none\\); change mesh.expert = 1"):
        load_config("tiny_random", {"mesh.expert": 2})
    with pytest.raises(ValueError, match="num_experts"):
        load_config("tiny_random", {"model.num_experts": 6, "model.experts_per_token": 2,
                                    "model.moe_intermediate_size": 64, "mesh.expert": 4})
    load_config("tiny_random", {"model.num_experts": 8, "model.experts_per_token": 2,
                                "model.moe_intermediate_size": 64, "mesh.expert": 4})