"""engine/planner/plan.py + `jaxfill plan`: FLOP and byte counts checked against what XLA
compiles and what the engine allocates; published KV sizes; bad input -> exit code 2.

How the FLOP checks work. `compiled.cost_analysis()["flops"]` is XLA's HloCostAnalysis
total for the compiled prefill forward. It counts a while loop's body ONCE, whatever the
trip count, and the attention impls are loops: `xla` walks KV blocks with dynamic bounds
(so its true attention FLOPs are invisible to the cost analysis), `reference` loops over
the sequences (trip count num_seqs = 1 here, so counting the body once is exact) and
scores each query against the sequence's whole page table, masked: a FULL [T, P*page]
score matrix, not the causal triangle. So:

* matmul part: compile the forward with attention replaced by a zero-FLOP stub (returns
  q), registered as an impl in pallas_kernels' IMPLS table. What remains is projections,
  MLP, the one-row LM head and elementwise work (norms, rope, silu: a few % at most);
  it must equal the planner's matmul FLOPs within 5%.
* attention part: (reference forward) - (stub forward) must equal the planner's
  `attention_flops(causal=False, kv_len=P*page_size)`, the full-matrix count the
  reference really computes, plus at most ELEMENTWISE_PER_SCORE elementwise FLOPs per score
  (softmax, mask);
  within 5% when head_dim >= 64 (tiny's head_dim 32 leaves the softmax ~5%). The
  causal count the planner reports is that same per-pair cost over the lower triangle
  incl. the diagonal, checked by brute force in test_visible_pairs.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import pytest
from flax import nnx

from jaxfill.models.execution_plan import ExecutionPlan
from jaxfill.engine.config import load_config
from jaxfill.engine.planner.hardware import Hardware, load_hardware
from jaxfill.engine.planner.plan import plan, plan_prefill, ttft_floor
from jaxfill.engine.planner.counts import (attention_flops, kv_bytes_per_token, matmul_flops, prefill_flops,
                                           visible_pairs)
from jaxfill.models.config import ModelConfig
from jaxfill.models.kv_cache import KVCache, single_sequence_metadata
from jaxfill.models.decoder import Decoder
from jaxfill.pallas_kernels.ragged_paged_attention import IMPLS
from jaxfill.serving.cli import main
from jaxfill.models.families.registry import param_count


# Elementwise FLOPs XLA counts per attention score beside the two matmuls: scale, the causal
# mask's compares and select, max, subtract, sum, divide (exp is a transcendental, counted
# apart). CI counted 8.6-9.7 per score on jaxlib 0.10.2 with YNNPACK fusions off
# (engine/cpu_flags.py, 2026-12-07); a missing matmul would fall far below `full`.
ELEMENTWISE_PER_SCORE = 12


def stub_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **kwargs):
    """Zero-FLOP stand-in for ragged paged attention: [T, Hq, D] in, [T, Hq, D] out."""
    return q


def compiled_flops(config_name: str, num_tokens: int, impl: str, monkeypatch, stages: int = 1) -> float:
    from jaxfill.models.forward import forward

    monkeypatch.setitem(IMPLS, "planner_test_stub", (__name__, "stub_attention"))
    cfg = config_name if isinstance(config_name, ModelConfig) else load_config(config_name).model
    page = 16
    n_pages = -(-num_tokens // page)
    model = nnx.eval_shape(lambda: Decoder(cfg, attention_impl=impl, plan=ExecutionPlan.stacked(stages)))  # shapes only, no init
    graphdef, state = nnx.split(model)
    cache = jax.eval_shape(lambda: KVCache.create(cfg, n_pages + 1, page, stages=stages))
    meta = single_sequence_metadata(num_tokens, 0, list(range(1, n_pages + 1)), page)
    tokens = jax.ShapeDtypeStruct((num_tokens,), jax.numpy.int32)
    compiled = forward.lower(graphdef, state, tokens, tokens, cache, meta).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"]), n_pages * page


@pytest.mark.parametrize("config_name", ["tiny_random", "bench"])
@pytest.mark.parametrize("num_tokens", [256, 2048])
def test_flops_match_xla_cost_analysis(config_name, num_tokens, monkeypatch):
    cfg = load_config(config_name).model
    stub, _ = compiled_flops(config_name, num_tokens, "planner_test_stub", monkeypatch)
    # One device, no 'sequence' split: the last layer runs the sampled row only.
    planned = matmul_flops(cfg, num_tokens, sampled_last_layer=True)
    assert abs(stub - planned) / planned < 0.05, (stub, planned)
    assert stub >= planned  # XLA adds elementwise work on top, never less matmul
    ref, kv_len = compiled_flops(config_name, num_tokens, "reference", monkeypatch)
    full = attention_flops(cfg, num_tokens, causal=False, kv_len=kv_len, sampled_last_layer=True)
    scores = cfg.num_heads * ((cfg.num_layers - 1) * num_tokens + 1) * kv_len
    # Exactly the two matmuls, plus at most ELEMENTWISE_PER_SCORE FLOPs per score.
    assert full <= ref - stub <= full + ELEMENTWISE_PER_SCORE * scores, (ref - stub, full, scores)
    if cfg.head_dim >= 64:  # 4 * head_dim FLOPs per score dwarf the elementwise ones
        assert abs((ref - stub) - full) / full < 0.05, (ref - stub, full)
    # The causal count is what a prefill needs: just over half of the full square.
    causal = attention_flops(cfg, num_tokens)
    square = attention_flops(cfg, num_tokens, causal=False, kv_len=kv_len)
    assert causal == square * (num_tokens + 1) // (2 * kv_len)


def test_latent_attention_flops_match_xla_cost_analysis(monkeypatch):
    """MLA (models/mixers/mla.py): every projection (q_a, q_b, kv_a, the absorbed kv_b on queries
    and outputs, o) once per token; attention as MQA over the 48-wide latent "head"."""
    cfg = load_config("tiny_random").model.replace(architecture="DeepseekV3ForCausalLM",
                              num_kv_heads=1, head_dim=48, rotary_dim=16, kv_lora_rank=32, q_lora_rank=40,
                              qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, rope_interleave=True)
    stub, kv_len = compiled_flops(cfg, 256, "planner_test_stub", monkeypatch)
    planned = matmul_flops(cfg, 256, sampled_last_layer=True)
    assert 1.0 <= stub / planned < 1.05, (stub, planned)
    ref, _ = compiled_flops(cfg, 256, "reference", monkeypatch)
    full = attention_flops(cfg, 256, causal=False, kv_len=kv_len, sampled_last_layer=True)
    scores = cfg.num_heads * ((cfg.num_layers - 1) * 256 + 1) * kv_len
    assert full <= ref - stub <= full + ELEMENTWISE_PER_SCORE * scores, (ref - stub, full, scores)


def test_deepseek_v3_kv_bytes_are_the_latent():
    """61 layers x (512 + 64) x 2 bytes = 70,272 per token: the pages hold the latent once
    (K-only pages, models/mixers/mla.py); int8 adds one f32 scale per token and layer."""
    cfg = load_config("deepseek_v3").model
    assert kv_bytes_per_token(cfg) == 70272
    assert kv_bytes_per_token(cfg, kv_cache_dtype="int8") == 61 * (576 + 4)
    assert KVCache.create(cfg.replace(num_layers=1, dense_layers=(0,)), num_pages=2, page_size=16,
                          dtype=None).nbytes() == 2 * 16 * 576 * 2
    # every device of a tensor x expert mesh holds the whole latent (once), its stage's layers
    for mesh, per_device in [({"mesh.expert": 32}, 70272), ({"mesh.tensor": 8, "mesh.expert": 4}, 70272)]:
        over = {**mesh, "engine.max_model_len": 65536}
        plan = plan_prefill(load_config("deepseek_v3", over), load_hardware("h100"), 32768)
        assert plan["kv_bytes_per_token_per_device"] == per_device, (mesh, plan["kv_bytes_per_token_per_device"])


@pytest.mark.parametrize("layout", ["unrolled", "scan", "stages"])
def test_planned_matmul_flops_match_each_layout_compiled(layout, monkeypatch):
    """The plan row's matmul FLOPs against the compiled forward of the layout the loader
    builds (models/execution_plan.py): unrolled (last layer on the sampled row), scanned
    and staged (every row of every layer). A stacked layout is one lax.scan, whose body
    the cost analysis counts once: one group of layers plus the LM head."""
    from jaxfill.engine.planner.counts import layer_matmul_params

    overrides = {"unrolled": {}, "scan": {"engine.scan_layers": True}, "stages": {"mesh.stage": 2}}[layout]
    config, num_tokens = load_config("bench", overrides), 256
    m, plan_ = config.model, ExecutionPlan.of_config(config)
    row = plan_prefill(config, H100, num_tokens)
    stub, _ = compiled_flops("bench", num_tokens, "planner_test_stub", monkeypatch, stages=plan_.layer_groups)
    head = matmul_flops(m, num_tokens) - m.num_layers * 2 * num_tokens * layer_matmul_params(m)
    in_body = m.num_layers // plan_.layer_groups  # layers the compiled program holds once
    expected = (row["matmul_flops"] - head) * in_body / m.num_layers + head
    assert abs(stub - expected) / expected < 0.05, (layout, stub, expected)
    assert stub >= expected


def test_visible_pairs_brute_force():
    for window in (None, 1, 5, 16):
        for context in (0, 3, 20):
            for n in (1, 7, 32):
                brute = sum(min(p + 1, window or 10**9) for p in range(context, context + n))
                assert visible_pairs(n, context, window) == brute, (window, context, n)


@pytest.mark.parametrize("config_name", ["tiny_random", "bench", "llama3_8b", "mistral_7b"])
def test_kv_bytes_per_token_equal_engine_allocation(config_name):
    cfg = load_config(config_name).model
    cache = KVCache.create(cfg, num_pages=3, page_size=16)
    assert cache.nbytes() / (cache.num_pages * cache.page_size) == kv_bytes_per_token(cfg)


def test_published_kv_sizes():
    assert kv_bytes_per_token(load_config("llama3_8b").model) == 131072  # 128 KiB/token bf16
    assert kv_bytes_per_token(load_config("llama2_7b").model) == 524288  # 512 KiB/token bf16
    assert kv_bytes_per_token(load_config("llama3_70b").model) == 327680


H100 = load_hardware("h100_sxm")


def test_plan_llama3_8b_by_hand():
    cfg = load_config("llama3_8b")
    row = plan_prefill(cfg, H100, 2048)
    m = cfg.model
    assert row["kv_bytes_per_request"] == 128 * 16 * 131072 and row["pages_per_request"] == 128
    weights = param_count(m) * 2
    assert row["weight_bytes"] == weights
    assert row["max_concurrent_requests"] == int((80e9 - weights) // (128 * 16 * 131072))
    # 2048 tokens of an 8B model on an H100 are compute bound: FLOPs / 989 TFLOP/s.
    assert row["bound"] == "compute"
    assert row["ttft_floor_s"] == pytest.approx(row["prefill_flops"] / 989.4e12, rel=1e-9)
    # Mostly linear in N with a growing quadratic share: 2 < decay < 4.
    assert 2.0 < row["decay_coefficient"] < 2.2
    assert row["decay_coefficient"] == pytest.approx(
        ttft_floor(m, cfg.mesh, H100, 4096) / ttft_floor(m, cfg.mesh, H100, 2048))
    # Short prompts read the weights faster than they multiply them: memory bound, decay ~1.
    short = plan_prefill(cfg, H100, 16)
    assert short["bound"] == "memory" and short["decay_coefficient"] < 1.1


def test_tensor_and_sequence_parallel():
    one = plan_prefill(load_config("llama3_70b"), H100, 4096)
    tp8 = plan_prefill(load_config("llama3_70b", {"mesh.tensor": 8}), H100, 4096)
    assert one["max_concurrent_requests"] == 0  # 141 GB of weights do not fit one 80 GB GPU
    # Everything splits 8 ways but the 2 norms per layer and the final norm (replicated).
    norms = (80 * 2 + 1) * 8192 * 2
    assert tp8["weight_bytes_per_device"] == (one["weight_bytes"] - norms) / 8 + norms
    assert tp8["collective_s"] > 0 and one["collective_s"] == 0
    # Compute splits 8 ways (8 KV heads: nothing replicated); the all-reduces come on top.
    assert tp8["compute_s"] == pytest.approx(one["compute_s"] / 8, rel=1e-6)
    assert tp8["ttft_floor_s"] == pytest.approx(tp8["compute_s"] + tp8["collective_s"])
    assert tp8["collective_s"] == pytest.approx(tp8["collective_bytes_per_device"] / 450e9)
    assert tp8["max_concurrent_requests"] > 0
    # Two all-reduces of [T, E] per layer, ring: 2 (n-1)/n of the buffer each; the last
    # layer's carry only the sampled row, [1, E].
    rows = 79 * 4096 + 1
    assert tp8["collective_bytes_per_device"] == pytest.approx(2 * 2 * 7 / 8 * rows * 8192 * 2)
    # tensor=16 with 8 KV heads: heads repeated twice, each rank stores one.
    tp16 = plan_prefill(load_config("llama3_70b", {"mesh.tensor": 16}), H100, 4096)
    assert tp16["kv_bytes_per_request"] == one["kv_bytes_per_request"]  # the model's logical K/V
    assert tp16["kv_bytes_per_request_per_device"] == one["kv_bytes_per_request"] / 8  # 1 of 16 heads
    assert tp8["kv_bytes_per_request_per_device"] == one["kv_bytes_per_request"] / 8
    sp2 = plan_prefill(load_config("llama3_70b", {"mesh.tensor": 8, "mesh.sequence": 2}), H100, 4096)
    assert sp2["collective_s"] > tp8["collective_s"] / 2  # + the K/V all-gather
    # 'sequence' keeps every row of the last layer (no sampled-row pruning).
    m70 = load_config("llama3_70b").model
    assert tp8["flops_per_device"] == pytest.approx(prefill_flops(m70, 4096) / 8, rel=1e-3)
    # A fresh prompt: pass-Q (what `auto` runs; causal attention, 1/N of the keys per rank)
    # and the pass-KV ring (asked for: its dense blocks compute the full T x T square).
    assert sp2["ring_mode"] == "pass-Q" and sp2["ttft_floor_s"] == sp2["pass_q_ttft_floor_s"]
    assert sp2["cheaper_ring_mode"] == ("pass-Q" if sp2["pass_q_ttft_floor_s"] <= sp2["pass_kv_ttft_floor_s"]
                                        else "pass-KV")
    causal = prefill_flops(m70, 4096, sampled_last_layer=False)
    square = causal - attention_flops(m70, 4096) + attention_flops(m70, 4096, causal=False, kv_len=4096)
    assert sp2["flops_per_device"] == pytest.approx(causal / 16, rel=1e-3)
    ring = plan_prefill(load_config("llama3_70b", {"mesh.tensor": 8, "mesh.sequence": 2,
                                                   "model.context_attention": "pass_kv"}), H100, 4096)
    assert ring["ring_mode"] == "pass-KV" and ring["flops_per_device"] == pytest.approx(square / 16, rel=1e-3)
    dp2 = plan_prefill(load_config("llama3_70b", {"mesh.tensor": 8, "mesh.data": 2}), H100, 4096)
    assert dp2["max_concurrent_requests"] == 2 * tp8["max_concurrent_requests"]
    assert dp2["ttft_floor_s"] == tp8["ttft_floor_s"]


def test_cpu_shared_by_fake_devices():
    hw = Hardware("cpu", "x", 1e11, 1e11, 1e10, 1e10, 1e10, "test", shared_by_mesh=True)
    cfg = load_config("bench")
    t1 = plan(cfg, hw, [2048])[0]["ttft_floor_s"]
    t2 = plan(load_config("bench", {"mesh.tensor": 2}), hw, [2048])[0]["ttft_floor_s"]
    assert t2 > t1  # two fake devices on the same cores: no faster, plus the all-reduces


def test_hardware_table_complete():
    for name in ("h100_sxm", "h200", "b200", "tpu_v5e", "tpu_v5p", "tpu_v6e", "H100", "TPU-v6e"):
        hw = load_hardware(name)
        assert hw.bf16_flops > 1e14 and hw.hbm_bytes > 1e10 and hw.hbm_bytes_per_s > 5e11
        assert hw.link_bytes_per_s > 1e11 and hw.source


def run_cli(argv, capsys):
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plan_cli_json(capsys):
    rc, out, _ = run_cli(["plan", "--config", "llama3_8b", "--hardware", "h200", "--prompt-len", "512",
                          "--prompt-len", "4096", "--set", "mesh.tensor=8", "--json"], capsys)
    assert rc == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt_len"] for r in rows] == [512, 4096]
    for key in ("prompt_len", "prefill_flops", "attention_flops", "kv_bytes_per_token", "kv_bytes_per_request",
                "ttft_floor_s", "max_concurrent_requests", "decay_coefficient"):
        assert key in rows[0], key
    assert rows[0]["mesh"]["tensor"] == 8 and rows[0]["kv_bytes_per_token"] == 131072


def test_plan_cli_table(capsys):
    rc, out, _ = run_cli(["plan", "--config", "tiny_random", "--hardware", "tpu_v6e"], capsys)
    assert rc == 0 and "TTFT floor" in out and "2048" in out and "tpu_v6e" in out


@pytest.mark.parametrize("config, formula", [
    ("qwen3_5_397b_a17b", (2, 15, 2, 256, 2)),  # only the 15 attention layers of 60 hold KV
    ("deepseek_v3", (61, 576, 2)),  # one latent row per token, K and V read from it
    ("minimax_m2", (2, 62, 8, 128, 2)),
])
def test_plan_table_explains_the_kv_bytes_it_reports(config, formula, capsys):
    """The KV line's factors multiply to the bytes it reports."""
    import math
    import re

    rc, out, _ = run_cli(["plan", "--config", config, "--set", "mesh.tensor=2", "--prompt-len", "128"], capsys)
    line = next(line for line in out.splitlines() if line.startswith("KV "))
    assert rc == 0 and tuple(int(n) for n in re.findall(r"(\d+)(?= layers| kv| x| B\))", line.split("(")[1])) == formula
    assert int(line.split()[1]) == math.prod(formula)


@pytest.mark.parametrize("argv, message", [
    (["--hardware", "a100"], "unknown hardware 'a100'"),
    (["--set", "mesh.tensor=3"], "mesh.tensor=3 does not divide model.num_heads=32"),
    (["--config", "qwen2_7b", "--set", "mesh.tensor=7"], "num_kv_heads=4"),
    (["--prompt-len", "0"], "must be positive"),
])
def test_plan_cli_bad_input(argv, message, capsys):
    argv = ["plan", "--config", "llama3_8b"] + argv if "--config" not in argv else ["plan"] + argv
    rc, out, err = run_cli(argv, capsys)
    assert rc == 2 and message in err and "Traceback" not in err, err


def test_plan_cli_past_max_model_len_plans_and_warns(capsys):
    rc, out, err = run_cli(["plan", "--config", "llama3_8b", "--prompt-len", "8192", "--json"], capsys)
    assert rc == 0 and "warning" in err and "max_position_embeddings=8192" in err
    assert json.loads(out)["prompt_len"] == 8192


@pytest.mark.parametrize("config_name", ["tiny_random", "llama3_8b"])
@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "float8_e4m3fn"])
def test_kv_transfer_bytes_and_time(config_name, kv_dtype):
    """--link-gbps: the prompt's K/V as the engine allocates it (KVCache.nbytes, scales
    included), moved at G Gbit/s = G * 1e9 / 8 bytes/s."""
    cfg = load_config(config_name, {"engine.kv_cache_dtype": kv_dtype})
    cache = jax.eval_shape(lambda: KVCache.create(cfg.model, 5, 16, kv_cache_dtype=kv_dtype))
    per_slot = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache)) / (5 * 16)
    hw = load_hardware("h100_sxm")
    row = plan_prefill(cfg, hw, 1000, link_gbps=25.0)
    assert row["kv_transfer_bytes"] == 1000 * per_slot  # every prompt token, not padded pages
    assert row["kv_transfer_s"] == pytest.approx(1000 * per_slot / (25.0e9 / 8), rel=1e-12)
    assert row["kv_transfer_over_ttft_floor"] == pytest.approx(row["kv_transfer_s"] / row["ttft_floor_s"])
    assert "kv_transfer_s" not in plan_prefill(cfg, hw, 1000)  # no link, no time


def test_kv_transfer_int8_moves_about_half_of_bf16():
    hw = load_hardware("h100_sxm")
    bf16, int8 = (plan_prefill(load_config("llama3_8b", {"engine.kv_cache_dtype": d}), hw, 4096, 100.0)
                  for d in ("auto", "int8"))
    assert bf16["kv_transfer_bytes"] == 4096 * 131072  # 128 KiB/token, published
    assert int8["kv_transfer_s"] / bf16["kv_transfer_s"] == pytest.approx((128 + 4) / 256)


def test_plan_cli_link_gbps(capsys):
    rc, out, _ = run_cli(["plan", "--config", "llama3_8b", "--hardware", "h200", "--prompt-len", "2048",
                          "--link-gbps", "400", "--json"], capsys)
    assert rc == 0
    row = json.loads(out)
    assert row["link_gbps"] == 400 and row["kv_transfer_bytes"] == 2048 * 131072
    assert row["kv_transfer_s"] == pytest.approx(2048 * 131072 / 50e9)
    rc, out, _ = run_cli(["plan", "--config", "llama3_8b", "--prompt-len", "2048", "--link-gbps", "400"], capsys)
    assert rc == 0 and "KV moved" in out and "5.37 ms" in out  # 256 MiB at 50 GB/s
    rc, _, err = run_cli(["plan", "--config", "llama3_8b", "--link-gbps", "0"], capsys)
    assert rc == 2 and "--link-gbps must be a positive" in err and "Traceback" not in err
