"""Granite 4.0-H (Mamba2 + MoE) under mesh.data = 2 and mesh.expert = 2 gives one device's
greedy tokens and top-5 logprobs: the checks of tests/test_hybrid_data_expert.py (state
slots per data replica, an aborted request's slot reused, a snapshot resumed on replica 1).
Slow (~25-40 s on 2 CPU cores: one subprocess, three engines compiling their steps)."""

import pytest

from test_hybrid_data_expert import check_data_and_expert


@pytest.mark.slow
def test_mamba2_moe_data_and_expert_match_one_device(tmp_path):
    check_data_and_expert(tmp_path, "granitemoehybrid")
