"""int8 / fp8 KV cache (engine.kv_cache_dtype) vs f32: accuracy, memory and CPU speed.

    python benchmarks/quant_kv.py [--positions 4096] [--repeats 5]

* perplexity of the trained tiny model (configs/tiny) on its held-out text: the same 64
  windows of BOS + 127 bytes as benchmarks/quant_weights.py (train.py's split and line
  starts), through the engine's paged forward, whose attention reads the pages it has
  just written, so every key and value goes through the quantized cache;
  modes: f32 KV, int8 KV, fp8 KV, and int8 weights + int8 KV;
* top-1 agreement with the f32 cache over `--positions` teacher-forced positions of the
  bench model (configs/bench.toml, random init), held-out bytes in 1024-token sequences;
* memory: KV bytes per token and requests that fit for llama3_8b per the planner
  (H100 SXM; TPU v5e with mesh.tensor=4 and 8: one v5e chip holds only 16 GB), bf16 vs
  int8 KV; and the engine's own pool (KVCache.nbytes) for the bench shape, bf16 vs int8;
* CPU speed on the bench model: one 1024-token prefill and batch-1 decode at context
  1024, median of `--repeats` warm runs of the jitted forward, per KV mode.

Writes benchmarks/results/quant_kv.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = 16
KV_MODES = ("auto", "int8", "float8_e4m3fn")


def _weights_bench():
    """benchmarks/quant_weights.py: the held-out split, NLL and timing helpers."""
    spec = importlib.util.spec_from_file_location("quant_weights_bench",
                                                  os.path.join(ROOT, "benchmarks", "quant_weights.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["quant_weights_bench"] = module
    spec.loader.exec_module(module)
    return module


QW = _weights_bench()


all_logits = QW.all_logits  # one definition: benchmarks/quant_weights.py


def perplexity(forward_fn) -> dict:
    from jaxfill.engine.config import load_config
    from jaxfill.models.checkpoint import load_hf_params

    batch = QW.held_out_batch()  # [64, 129]: BOS + 128 bytes
    cfg = load_config("tiny")
    modes = [("auto", kv) for kv in KV_MODES] + [("int8", "int8")]
    out = {}
    for wd, kv in modes:
        model = load_hf_params(cfg.model_path, dataclasses.replace(cfg.model, weight_dtype=wd), progress=False)
        losses = [QW.nll(all_logits(forward_fn, model, row[:-1], kv), row[1:]) for row in batch]
        name = f"weights={wd},kv={kv}"
        out[name] = {"nats_per_byte": float(np.mean(losses)), "perplexity": float(np.exp(np.mean(losses)))}
        print(name, out[name], flush=True)
    base = out["weights=auto,kv=auto"]["perplexity"]
    out["change_vs_f32"] = {k: v["perplexity"] / base - 1 for k, v in out.items() if k.startswith("weights")}
    return out


def top1_agreement(forward_fn, positions: int) -> dict:
    from jaxfill.engine.config import load_config
    from jaxfill.models.checkpoint import quantize_model
    from jaxfill.models.decoder import Decoder

    train = QW.load_train_module()
    _, held = train.load_corpus()
    f32 = Decoder(load_config("bench").model)
    int8w = quantize_model(f32)
    modes = {"kv=int8": (f32, "int8"), "kv=float8_e4m3fn": (f32, "float8_e4m3fn"),
             "weights=int8,kv=int8": (int8w, "int8")}
    seq = 1024
    stats = {k: {"agree": 0, "kl": []} for k in modes}
    total = 0
    for s in range(-(-positions // seq)):
        tokens = held[s * seq:(s + 1) * seq].astype(np.int32)
        a = all_logits(forward_fn, f32, tokens, "auto")
        la = a - a.max(-1, keepdims=True)
        la -= np.log(np.exp(la).sum(-1, keepdims=True))
        total += len(tokens)
        for name, (model, kv) in modes.items():
            b = all_logits(forward_fn, model, tokens, kv)
            lb = b - b.max(-1, keepdims=True)
            lb -= np.log(np.exp(lb).sum(-1, keepdims=True))
            stats[name]["agree"] += int((a.argmax(-1) == b.argmax(-1)).sum())
            stats[name]["kl"].append(float(np.mean((np.exp(la) * (la - lb)).sum(-1))))
    return {"positions": total, **{k: {"top1_agreement": v["agree"] / total,
                                       "mean_kl_f32_to_mode_nats": float(np.mean(v["kl"]))}
                                   for k, v in stats.items()}}


def memory() -> dict:
    from jaxfill.engine.config import load_config
    from jaxfill.engine.planner.hardware import load_hardware

    out = {}
    for hw_name, tensor in (("h100_sxm", 1), ("tpu_v5e", 4), ("tpu_v5e", 8)):
        hw = load_hardware(hw_name)
        row = {}
        for kv in ("auto", "int8"):
            cfg = load_config("llama3_8b", {"engine.kv_cache_dtype": kv, "mesh.tensor": tensor})
            from jaxfill.engine.planner.plan import plan_prefill

            p = plan_prefill(cfg, hw, 2048)
            row[kv] = {"kv_bytes_per_token": p["kv_bytes_per_token"],
                       "requests_that_fit_2048": p["max_concurrent_requests"]}
        row["fit_ratio"] = row["int8"]["requests_that_fit_2048"] / max(row["auto"]["requests_that_fit_2048"], 1)
        out[f"llama3_8b bf16 weights, {hw_name} x tensor={tensor}"] = row
    from jaxfill.engine.engine import Engine
    from jaxfill.engine.planner.counts import kv_bytes_per_token

    pool = {}  # the engine's own allocated cache (engine.num_pages 2048 x 16), bench shape
    for name, dtype, kv in (("bf16", "bfloat16", "auto"), ("f32", "float32", "auto"),
                            ("int8", "float32", "int8"), ("float8_e4m3fn", "float32", "float8_e4m3fn")):
        eng = Engine.from_config("bench", overrides={"model.dtype": dtype, "engine.kv_cache_dtype": kv},
                                 progress=False)
        st = eng.stats()
        planned = kv_bytes_per_token(eng.runner.config.model, kv_cache_dtype=kv)
        assert st["kv_bytes_per_token"] == planned, (name, st["kv_bytes_per_token"], planned)
        pool[name] = {"pool_bytes": st["kv_cache_bytes"], "bytes_per_token": st["kv_bytes_per_token"],
                      "planner_bytes_per_token": planned}
        eng.close()
        del eng
    pool["bf16_over_int8"] = pool["bf16"]["pool_bytes"] / pool["int8"]["pool_bytes"]
    out["engine_pool_bench_shape"] = pool
    return out


def speed(forward_fn, repeats: int) -> dict:
    from jaxfill.engine.config import load_config
    from jaxfill.models.kv_cache import KVCache, single_sequence_metadata
    from jaxfill.models.decoder import Decoder

    model = Decoder(load_config("bench").model)
    graphdef, state = nnx.split(model)
    n = 1024
    pages = list(range(1, n // PAGE + 2))
    out = {}
    for kv in KV_MODES:
        box = {"cache": KVCache.create(model.config, len(pages) + 1, PAGE, fill_value=float("nan"),
                                       kv_cache_dtype=kv)}
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, n), jnp.int32)
        meta = single_sequence_metadata(n, 0, pages, PAGE)

        def prefill():
            logits, box["cache"] = forward_fn(graphdef, state, tokens, jnp.arange(n, dtype=jnp.int32),
                                              box["cache"], meta)
            return logits

        t_prefill = QW.timed(prefill, repeats)
        dmeta = single_sequence_metadata(1, n, pages, PAGE, pad_to=16)
        dtok, dpos = jnp.zeros(16, jnp.int32), jnp.full(16, n, jnp.int32)

        def decode():
            logits, box["cache"] = forward_fn(graphdef, state, dtok, dpos, box["cache"], dmeta)
            return logits

        t_decode = QW.timed(decode, repeats)
        out[f"kv={kv}"] = {"prefill_1024_s": t_prefill, "prefill_tok_s": n / t_prefill,
                           "decode_step_s": t_decode, "decode_tok_s_batch1": 1 / t_decode}
        print(kv, out[f"kv={kv}"], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--positions", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sections", default="memory,perplexity,top1,speed",
                    help="comma-separated subset; others are kept from an existing --output")
    ap.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "results", "quant_kv.json"))
    args = ap.parse_args()
    from jaxfill.models.forward import forward

    result = {}
    if os.path.exists(args.output):
        with open(args.output) as f:
            result = json.load(f)
    result.update({"machine": f"{os.cpu_count()} CPUs", "jax": jax.__version__})
    todo = set(args.sections.split(","))
    sections = {"memory": ("memory", memory), "perplexity": ("perplexity_tiny_heldout", lambda: perplexity(forward)),
                "top1": ("top1_bench", lambda: top1_agreement(forward, args.positions)),
                "speed": ("speed_bench", lambda: speed(forward, args.repeats))}
    for name, (key, fn) in sections.items():
        if name in todo:
            result[key] = fn()
            print(json.dumps(result[key]), flush=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
