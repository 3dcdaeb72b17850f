"""`jaxfill plan` with mesh.stage (pipeline parallelism, models/parallel/pipeline.py): weights and KV
per device against the sharded shapes of `Decoder(config, plan=ExecutionPlan.stacked(p))` under an abstract mesh,
and every new number against a hand computation."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import numpy as np
import pytest
from flax import nnx

from jaxfill.models.execution_plan import ExecutionPlan
from jaxfill.engine.config import load_config
from jaxfill.engine.planner.hardware import load_hardware
from jaxfill.engine.memory import pool_pages
from jaxfill.engine.planner.plan import kv_pool_pages, plan_prefill, ttft_floor
from jaxfill.engine.validation import check_mesh
from jaxfill.engine.planner.counts import (attention_flops, kv_bytes_per_token, matmul_flops,
                                           weight_bytes)
from jaxfill.engine.planner.layout import bubble_fraction, kv_bytes_per_token_per_device, weight_bytes_per_device
from jaxfill.models.kv_cache import KVCache
from jaxfill.models.decoder import Decoder
from jaxfill.models.sharding import MESH_AXES, kv_cache_sharding, logical_spec, var_axes
from jaxfill.serving.cli import main

H100 = load_hardware("h100_sxm")


def abstract_mesh(mesh):  # MeshSettings -> an AbstractMesh of its axes (no devices needed)
    return jax.sharding.AbstractMesh(tuple(getattr(mesh, a) for a in MESH_AXES), MESH_AXES)


MOE = {"model.num_experts": 8, "model.experts_per_token": 2, "model.moe_intermediate_size": 64}


def shards(spec, mesh) -> int:
    """Devices one array is split over under `spec`."""
    names = [a for entry in spec if entry is not None for a in (entry if isinstance(entry, tuple) else (entry,))]
    return int(np.prod([dict(zip(mesh.axis_names, mesh.axis_sizes))[a] for a in names]))


def sharded_param_bytes(config) -> float:
    """One device's bytes of the pipelined model's params: every leaf's global bytes over
    the devices its logical axes split it across (models/sharding.py's rules)."""
    mesh = abstract_mesh(config.mesh)
    model = nnx.eval_shape(lambda: Decoder(config.model, plan=ExecutionPlan.of_config(config)))
    total = 0.0
    for var in jax.tree.leaves(nnx.state(model), is_leaf=lambda x: isinstance(x, nnx.Variable)):
        spec = logical_spec(var_axes(var), mesh=mesh, shape=var.shape)
        total += var.size * var.dtype.itemsize / shards(spec, mesh)
    return total


@pytest.mark.parametrize("name, overrides", [
    ("tiny_random", {"mesh.stage": 2}),
    ("tiny_random", {"mesh.stage": 2, "mesh.tensor": 2}),  # 2 KV heads split over tensor
    ("tiny_random", {"mesh.stage": 4, "mesh.tensor": 4}),  # KV weights replicated (r = 2)
    ("tiny_random", {"mesh.stage": 2, "model.vocab_size": 321}),  # vocab replicated
    ("tiny_random", {"mesh.stage": 2, "mesh.tensor": 2, "model.weight_dtype": "int8"}),
    ("tiny_random", {"mesh.stage": 2, "mesh.tensor": 2, "model.attention_bias": True,
                     "model.tie_word_embeddings": True}),
    ("tiny_random", {"mesh.tensor": 2, "mesh.data": 2}),
    ("tiny_random", {**MOE, "mesh.expert": 2, "mesh.tensor": 2}),
    ("tiny_random", {**MOE, "mesh.expert": 4, "mesh.stage": 2, "model.weight_dtype": "int8"}),
    ("tiny_random", {**MOE, "mesh.expert": 2, "model.dense_layers": [0]}),  # layers of two kinds
])
def test_weights_per_device_equal_sharded_shapes(name, overrides):
    config = load_config(name, overrides)
    assert weight_bytes_per_device(config.model, config.mesh) == sharded_param_bytes(config)


def test_weights_per_device_equal_sharded_shapes_llama3_8b():
    config = load_config("llama3_8b", {"mesh.stage": 4, "mesh.tensor": 2})
    assert weight_bytes_per_device(config.model, config.mesh) == sharded_param_bytes(config)


@pytest.mark.parametrize("overrides", [{"mesh.stage": 2}, {"mesh.stage": 2, "mesh.tensor": 4},
                                       {"mesh.stage": 4, "engine.kv_cache_dtype": "int8"}])
def test_kv_per_device_equal_sharded_cache(overrides):
    """The staged cache's per-token bytes on one device: each entry's global bytes over its
    shards, per page slot of one replica."""
    config = load_config("tiny_random", overrides)
    m, mesh, dtype = config.model, config.mesh, config.engine.kv_cache_dtype
    am = abstract_mesh(mesh)
    cache = jax.eval_shape(lambda: KVCache.create(m, 4, 16, kv_cache_dtype=dtype, stages=mesh.stage))
    r = mesh.tensor // m.num_kv_heads if m.num_kv_heads < mesh.tensor else 1  # heads repeated to tensor
    per_dev = 0.0
    for leaf in jax.tree.leaves(cache):
        spec = kv_cache_sharding(am, staged=True, axes=("cache_pages", "cache_slots", "cache_heads",
                                                        "cache_head_dim")[:leaf.ndim - 1]).spec
        per_dev += leaf.size * leaf.dtype.itemsize * r / shards(spec, am)
    assert kv_bytes_per_token_per_device(m, mesh, dtype) == per_dev / (4 * 16)


def test_llama3_8b_stage2_by_hand():
    one = load_config("llama3_8b")
    two = load_config("llama3_8b", {"mesh.stage": 2})
    m = one.model
    e, v, b = m.hidden_size, m.vocab_size, 2
    vocab = 2 * v * e * b  # embedding + untied LM head
    layers = weight_bytes(m) - vocab - e * b  # all 32 layers
    assert weight_bytes_per_device(m, two.mesh) == layers / 2 + vocab / 2 + e * b
    row1, row2 = plan_prefill(one, H100, 2048), plan_prefill(two, H100, 2048)
    assert row2["weight_bytes_per_device"] == layers / 2 + vocab / 2 + e * b
    assert row2["kv_bytes_per_token_per_device"] == 131072 / 2
    assert row2["kv_bytes_per_request_per_device"] == row1["kv_bytes_per_request_per_device"] / 2
    assert row2["kv_bytes_per_request"] == row1["kv_bytes_per_request"]  # the model's logical K/V
    free = 80e9 - (layers / 2 + vocab / 2 + e * b)
    assert row2["max_concurrent_requests"] == int(free // (128 * 16 * 131072 / 2))
    assert row2["max_concurrent_requests"] > 2 * row1["max_concurrent_requests"]
    assert (row2["microbatches"], row2["bubble_fraction"]) == (4, pytest.approx(0.2))
    assert (row1["microbatches"], row1["bubble_fraction"], row1["stage_transfer_s"]) == (1, 0.0, 0.0)


def test_bubble_with_microbatches_cut_to_a_divisor():
    assert bubble_fraction(2, 4) == pytest.approx(0.2) and bubble_fraction(4, 8) == pytest.approx(3 / 11)
    cfg = load_config("llama3_8b", {"mesh.stage": 4, "mesh.microbatches": 4})
    row = plan_prefill(cfg, H100, 6)  # 6 tokens: 3 microbatches of 2
    assert row["microbatches"] == 3 and row["bubble_fraction"] == pytest.approx(3 / 6)


def test_communication_per_token_by_hand():
    row = plan_prefill(load_config("llama3_8b", {"mesh.stage": 4, "mesh.tensor": 2}), H100, 2048)
    assert row["stage_boundary_bytes_per_token"] == 4096 * 2  # one [E] bf16 row per boundary
    assert row["stage_boundary_bytes_per_token_total"] == 3 * 4096 * 2
    # 8 layers per stage x 2 ring all-reduces x 2 (2-1)/2 of the [E] row.
    assert row["tensor_allreduce_bytes_per_token_per_device"] == 8 * 2 * 1 * 4096 * 2
    plain = plan_prefill(load_config("llama3_8b"), H100, 2048)
    assert plain["stage_boundary_bytes_per_token_total"] == 0 == plain["tensor_allreduce_bytes_per_token_per_device"]


def test_ttft_floor_stage2_compute_bound_by_hand():
    """8B, 2048 tokens, 2 stages x 4 microbatches: 5 ticks of a quarter of the prompt
    through 16 layers, the LM head row on a vocab half, one [512, E] hand-over."""
    cfg = load_config("llama3_8b", {"mesh.stage": 2})
    m = cfg.model
    head = 2 * m.hidden_size * m.vocab_size
    layer_flops = matmul_flops(m, 2048) - head + attention_flops(m, 2048)
    flops = 5 * layer_flops / (4 * 2) + head / 2
    handover = 512 * 4096 * 2 / 450e9
    row = plan_prefill(cfg, H100, 2048)
    assert row["bound"] == "compute" and row["flops_per_device"] == pytest.approx(flops, rel=1e-12)
    assert row["stage_transfer_s"] == pytest.approx(handover, rel=1e-12)
    assert row["ttft_floor_s"] == pytest.approx(flops / 989.4e12 + handover, rel=1e-12)
    one = plan_prefill(load_config("llama3_8b"), H100, 2048)
    # 5 ticks of an eighth of the work each: 5/8 of one device's time, never the ideal 1/2.
    assert one["ttft_floor_s"] / 2 < row["ttft_floor_s"] < one["ttft_floor_s"]


def test_ttft_floor_stage2_memory_bound_by_hand():
    """16 tokens: every tick re-reads the stage's weights; K/V written once; the embedding
    rows gathered and the LM head read once, each half per device."""
    cfg = load_config("llama3_8b", {"mesh.stage": 2})
    m = cfg.model
    e, v, b = m.hidden_size, m.vocab_size, 2
    layers = weight_bytes(m) - 2 * v * e * b - e * b
    nbytes = 5 * layers / 2 + 16 * 131072 / 2 + (v * e * b + 16 * e * b) / 2 + e * b
    row = plan_prefill(cfg, H100, 16)
    assert row["bound"] == "memory" and row["bytes_per_device"] == pytest.approx(nbytes, rel=1e-12)
    assert row["ttft_floor_s"] == pytest.approx(nbytes / 3.35e12 + 4 * 4096 * 2 / 450e9, rel=1e-12)


@pytest.mark.parametrize("tokens", [16, 2048])
def test_ttft_floor_stage1_unchanged(tokens):
    """Regression: without stages the floor is the whole prompt's max(FLOPs / peak,
    bytes / bandwidth), mesh.microbatches ignored."""
    m = load_config("llama3_8b").model
    e, v = m.hidden_size, m.vocab_size
    nbytes = weight_bytes(m) - v * e * 2 + tokens * e * 2 + tokens * kv_bytes_per_token(m)
    flops = matmul_flops(m, tokens, sampled_last_layer=True) + attention_flops(m, tokens, sampled_last_layer=True)
    expected = max(flops / 989.4e12, nbytes / 3.35e12)
    for micro in (1, 4, 8):
        mesh = load_config("llama3_8b", {"mesh.microbatches": micro}).mesh
        assert ttft_floor(m, mesh, H100, tokens) == pytest.approx(expected, rel=1e-12)


def test_kv_pool_pages_stage2_by_hand():
    cfg = load_config("llama3_8b", {"mesh.stage": 2})
    pool = kv_pool_pages(cfg, H100, activation_bytes=1 << 30)
    page_bytes = 16 * 131072 // 2
    assert pool["kv_page_bytes_per_device"] == page_bytes
    assert pool["kv_pool_pages"] == pool_pages(80e9, weight_bytes_per_device(cfg.model, cfg.mesh), 1 << 30,
                                               page_bytes, cfg.engine.memory_utilization)


def test_stage_must_divide_layers():
    """load_config refuses it too; the planner's own check covers configs built otherwise."""
    cfg = load_config("llama3_8b")
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, stage=3))
    with pytest.raises(ValueError, match="mesh.stage=3 does not divide model.num_layers=32"):
        check_mesh(cfg.model, cfg.mesh)
    with pytest.raises(ValueError, match="mesh.stage=3"):
        plan_prefill(cfg, H100, 128)


def test_plan_cli_stage(capsys):
    rc = main(["plan", "--config", "llama3_8b", "--hardware", "h100_sxm", "--prompt-len", "2048",
               "--set", "mesh.stage=2", "--set", "mesh.microbatches=4", "--json"])
    row = json.loads(capsys.readouterr().out)
    assert rc == 0 and row["mesh"]["stage"] == 2 and row["mesh"]["microbatches"] == 4
    assert row["bubble_fraction"] == pytest.approx(0.2) and row["stage_transfer_s"] > 0
    assert math.isclose(row["ttft_floor_s"], plan_prefill(load_config("llama3_8b", {"mesh.stage": 2}),
                                                          H100, 2048)["ttft_floor_s"])
    rc = main(["plan", "--config", "llama3_8b", "--prompt-len", "2048", "--set", "mesh.stage=2"])
    out = capsys.readouterr().out
    assert rc == 0 and "stage=2" in out and "bubble" in out and "0.2" in out
    rc = main(["plan", "--config", "llama3_8b", "--set", "mesh.stage=3"])
    err = capsys.readouterr().err
    assert rc == 2 and "mesh.stage=3 must divide the model's 32 layers" in err and "Traceback" not in err
