"""engine/planner/context.py + the planner under mesh.sequence (context parallelism): the
KV pool split over the sequence ranks, pass-Q vs pass-KV ring bytes, the auto-sized pool,
and `jaxfill plan` at 1M tokens. Arithmetic only: every check is a formula from the model
shape (llama3_8b: 32 layers, 32 q / 8 kv heads x 128, bf16: 128 KiB of K/V per token)."""

from __future__ import annotations

import json

import pytest

from jaxfill.engine import memory
from jaxfill.engine.config import load_config
from jaxfill.engine.planner.hardware import load_hardware
from jaxfill.engine.planner.plan import best_costs, device_costs, kv_pool_pages, plan_prefill
from jaxfill.engine.planner.context import PASS_KV, PASS_Q, activation_estimate, ring_modes
from jaxfill.engine.planner.counts import attention_flops, kv_bytes_per_token
from jaxfill.engine.planner.layout import weight_bytes_per_device
from jaxfill.serving.cli import main
from xla_flags import fake_devices

H200 = load_hardware("h200")
MILLION = 1 << 20
LONG = {"model.max_position_embeddings": 2 * MILLION, "engine.max_model_len": 2 * MILLION}


def llama(sequence: int, **extra):
    return load_config("llama3_8b", {"mesh.sequence": sequence, **LONG, **extra})


def test_kv_per_device_halves_with_sequence():
    rows = {n: plan_prefill(llama(n), H200, 4096) for n in (1, 2, 4)}
    assert kv_bytes_per_token(llama(1).model) == 128 << 10  # 2 x 32 x 8 x 128 x 2 B
    for n, row in rows.items():
        assert row["kv_bytes_per_device"] == 4096 * (128 << 10) / n
        assert row["kv_bytes_per_request"] == 4096 * (128 << 10)  # the logical K/V does not change
    assert rows[1]["ring_mode"] is None and rows[2]["ring_mode"] in (PASS_Q, PASS_KV)
    tp2 = plan_prefill(llama(2, **{"mesh.tensor": 2}), H200, 4096)  # and / tensor on top
    assert tp2["kv_bytes_per_device"] == rows[4]["kv_bytes_per_device"]


def test_one_million_tokens_llama3_8b_h200_sequence_8():
    cfg = llama(8)
    row = plan_prefill(cfg, H200, MILLION)
    kv_dev = MILLION * kv_bytes_per_token(cfg.model) / 8
    assert kv_dev == 16 << 30 and row["kv_bytes_per_device"] == kv_dev
    weights = weight_bytes_per_device(cfg.model, cfg.mesh)
    act = activation_estimate(cfg.model, cfg.mesh, cfg.engine.max_num_batched_tokens)
    assert row["fits"] == (weights + kv_dev + act <= 0.9 * 141e9) and row["fits"]
    assert not plan_prefill(llama(1), H200, MILLION)["fits"]  # 128 GiB of K/V on one H200
    both = {r: device_costs(cfg.model, cfg.mesh, H200, MILLION, ring=r) for r in (PASS_Q, PASS_KV)}
    assert row["ttft_floor_s"] == both[PASS_Q].ttft_s and row["ring_mode"] == PASS_Q  # what `auto` runs
    # At 1M the ring's dense blocks (the whole T x T square) cost more than pass-Q's bytes.
    assert row["cheaper_ring_mode"] == PASS_Q == min(both, key=lambda r: both[r].ttft_s)
    two = best_costs(cfg.model, cfg.mesh, H200, 2 * MILLION).ttft_s
    assert row["decay_coefficient"] == pytest.approx(two / row["ttft_floor_s"], rel=1e-12)
    assert 3 < row["decay_coefficient"] < 4  # attention-bound: close to quadratic


def test_ring_bytes_by_hand():
    cfg = llama(4, **{"mesh.tensor": 2})
    t, n, layers = 8192, 4, 32
    hq, hkv, d = 16, 4, 128  # per tensor rank
    q = device_costs(cfg.model, cfg.mesh, H200, t, ring=PASS_Q)
    kv = device_costs(cfg.model, cfg.mesh, H200, t, ring=PASS_KV)
    tensor = layers * 2 * (2 * 1 / 2) * (t / n) * 4096 * 2  # the two all-reduces per layer
    share = (n - 1) / n
    pass_q = share * t * ((hq + 2 * hkv) * d * 2 + hq * (d + 1) * 4 + hq * 4)
    assert q.collective_bytes == pytest.approx(tensor + layers * pass_q, rel=1e-12)
    assert kv.collective_bytes == pytest.approx(tensor + layers * share * t * 2 * hkv * d * 2, rel=1e-12)
    # Attention FLOPs split over tensor x sequence; the ring computes the full square.
    extra = attention_flops(cfg.model, t, causal=False, kv_len=t) - attention_flops(cfg.model, t)
    assert kv.flops - q.flops == pytest.approx(extra / 8, rel=1e-9)


def test_pass_kv_for_a_fresh_prompt_with_gqa():
    row = plan_prefill(llama(8), H200, 8192)  # 4 q heads per kv head: the ring sends 1/6 of pass-Q's gather
    assert row["ring_mode"] == PASS_Q and row["cheaper_ring_mode"] == PASS_KV  # auto runs pass-Q
    row = plan_prefill(llama(8, **{"model.context_attention": "pass_kv"}), H200, 8192)
    assert row["ring_mode"] == PASS_KV and row["ttft_floor_s"] == row["pass_kv_ttft_floor_s"]
    assert row["pass_kv_collective_bytes_per_device"] < row["pass_q_collective_bytes_per_device"] / 6
    # Not eligible: a cached prefix, quantized pages, pass_q forced, no 'sequence'.
    cfg = llama(8)
    assert ring_modes(cfg.model, cfg.mesh, context=16) == (PASS_Q,)
    assert ring_modes(cfg.model, cfg.mesh, kv_cache_dtype="int8") == (PASS_Q,)
    assert plan_prefill(llama(8, **{"model.context_attention": "pass_q"}), H200, 8192)["ring_mode"] == PASS_Q
    assert plan_prefill(llama(8, **{"engine.kv_cache_dtype": "int8"}), H200, 8192)["ring_mode"] == PASS_Q
    assert ring_modes(cfg.model, llama(1).mesh) == (None,)


def test_pool_pages_split_over_sequence():
    per_device = memory.pool_pages(1000, 100, 50, 100, 0.5)  # (500 - 150) // 100
    assert per_device == 3
    assert memory.pool_pages(1000, 100, 50, 100, 0.5, sequence=4) == 12  # each rank holds 3
    assert memory.pool_pages(100, 100, 0, 10, 0.9, sequence=8) == 0
    with pytest.raises(ValueError, match="sequence"):
        memory.pool_pages(1000, 100, 50, 100, 0.5, sequence=0)
    one, four = (kv_pool_pages(llama(n), H200, 1 << 30)["kv_pool_pages"] for n in (1, 4))
    assert four == 4 * one and four % 4 == 0


def test_plan_cli_one_million(capsys):
    argv = ["plan", "--config", "llama3_8b", "--prompt-len", str(MILLION), "--hardware", "h200",
            "--set", "mesh.sequence=8"]
    assert main(argv) == 0  # llama3_8b's rope stops at 8192 positions: planned anyway, and said
    out, err = capsys.readouterr()
    assert "warning" in err and "max_position_embeddings=8192" in err and "Traceback" not in err
    assert "KV bytes per device" in out and "16 GiB" in out
    extra = ["--set", f"model.max_position_embeddings={2 * MILLION}", "--set", f"engine.max_model_len={2 * MILLION}"]
    assert main(argv + extra) == 0
    out, err = capsys.readouterr()
    assert "warning" not in err
    assert "KV bytes per device" in out and "16 GiB" in out and "pass-Q" in out and "TTFT(2N)/TTFT(N)" in out
    assert main(argv + extra + ["--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["kv_bytes_per_device"] == 16 << 30 and row["fits"] is True and row["ring_mode"] == PASS_Q


POOL_WORKER = """
import json
from jaxfill.engine import memory
memory.host_memory_available = lambda: 24 << 20  # a pool of a few hundred pages
from jaxfill.engine.config import load_config
from jaxfill.engine.engine import Engine
cfg = load_config("tiny_random", {"engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64],
                                  "engine.max_num_seqs": 4, "engine.max_model_len": 256, "engine.num_pages": 0,
                                  "engine.memory_utilization": 0.5, "mesh.sequence": 2})
p = Engine(cfg, progress=False, warmup=False).runner.pool
m = cfg.model
print("RESULT " + json.dumps(dict(pages=p.num_pages, page_bytes=p.page_bytes, capacity=p.capacity_bytes,
      in_use=p.in_use_bytes, act=p.activation_bytes, per_token=m.num_layers * 2 * m.num_kv_heads * m.head_dim * 4,
      page_size=cfg.engine.page_size)))
"""


@pytest.mark.slow
def test_engine_pool_under_sequence_2():
    """engine.num_pages = 0 on 2 fake devices, sequence = 2: page_bytes is one page as a
    device stores it (its probe shard holds probe_pages / 2 pages), and the pool is
    2 x what one device fits."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=fake_devices(2), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", POOL_WORKER], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads([x for x in out.stdout.splitlines() if x.startswith("RESULT ")][-1][len("RESULT "):])
    assert r["page_bytes"] == r["page_size"] * r["per_token"]  # f32 tiny_random, whole heads per device
    per_device = int((r["capacity"] * 0.5 - r["in_use"] - r["act"]) // r["page_bytes"])
    assert 50 < per_device and r["pages"] == 2 * per_device
