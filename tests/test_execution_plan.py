"""One execution plan (models/execution_plan.py): the layout the loader builds and the
last-layer pruning the planner counts come from one rule, the model's."""

import pytest

from jaxfill.engine.config import load_config
from jaxfill.models.execution_plan import ExecutionPlan
from jaxfill.engine.planner.hardware import load_hardware
from jaxfill.engine.planner.plan import plan_prefill
from jaxfill.engine.planner.counts import attention_flops, matmul_flops

LAYOUTS = {"unrolled": {}, "scan": {"engine.scan_layers": True}, "stages": {"mesh.stage": 2}}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_plan_names_the_layout_and_who_prunes(layout):
    cfg = load_config("llama3_8b", LAYOUTS[layout])
    plan = ExecutionPlan.of_config(cfg)
    assert plan.layout == layout
    assert plan.layer_groups == {"unrolled": 1, "scan": cfg.model.num_layers, "stages": 2}[layout]
    assert plan.prunes_last_layer == (layout == "unrolled")


def test_sequence_split_does_not_prune():
    assert not ExecutionPlan.of_config(load_config("llama3_8b", {"mesh.sequence": 2})).prunes_last_layer


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_planner_counts_the_cut_only_where_the_model_makes_it(layout):
    """engine.scan_layers used to be counted with the sampled-row last layer, which the
    scanned model never runs (a miscount of the last layer's q/o/MLP at every length)."""
    cfg = load_config("llama3_8b", LAYOUTS[layout])
    row = plan_prefill(cfg, load_hardware("h100_sxm"), 2048)
    pruned = ExecutionPlan.of_config(cfg).prunes_last_layer
    m = cfg.model
    assert row["matmul_flops"] == matmul_flops(m, 2048, sampled_last_layer=pruned)
    assert row["attention_flops"] == attention_flops(m, 2048, sampled_last_layer=pruned)
    full = matmul_flops(m, 2048) + attention_flops(m, 2048)
    assert (row["prefill_flops"] < full) == pruned and row["prefill_flops"] <= full


def test_the_loader_builds_the_plans_layout():
    from jaxfill.engine.loading import build_model

    cfg = load_config("tiny_random", {"engine.scan_layers": True})
    model = build_model(cfg, progress=False)
    assert model.stages == ExecutionPlan.of_config(cfg).layer_groups == cfg.model.num_layers
