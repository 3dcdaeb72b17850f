"""int8 weights (model.weight_dtype = "int8") vs f32: accuracy and CPU speed.

    python benchmarks/quant_weights.py [--positions 4096] [--repeats 5]

* perplexity of the trained tiny model (configs/tiny) on its held-out text (the last 5%
  of every play, configs/tiny/train.py's split): 64 windows of BOS + 127 bytes at the
  same line starts train.py's `evaluate` uses, through the engine's paged forward;
* top-1 agreement with f32 over `--positions` teacher-forced positions of the bench model
  (configs/bench.toml, random init), on held-out bytes in 1024-token sequences;
* CPU speed on the bench model: one 1024-token prefill, and batch-1 decode (one token at
  context 1024), median of `--repeats` warm runs of the jitted forward;
* the matmul alone at the bench MLP shape: f32, w8a16 (int8 weight cast in the jitted
  matmul, scale after) and w8a8 (per-token dynamic int8 activations, int8 x int8 ->
  int32 dot_general), to decide whether w8a8 is worth offering on XLA:CPU.

Writes benchmarks/results/quant_weights.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = 16


def load_train_module():
    path = os.path.join(ROOT, "configs", "tiny", "train.py")
    spec = importlib.util.spec_from_file_location("tiny_train", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["tiny_train"] = module  # its dataclasses need the module registered
    spec.loader.exec_module(module)
    return module


def all_logits(forward_fn, model, tokens: np.ndarray, kv: str = "auto") -> np.ndarray:  # [T] -> [T, V]
    """Logits at every position of one prompt, on a NaN-filled cache of dtype `kv`."""
    from jaxfill.models.kv_cache import KVCache, single_sequence_metadata

    n = len(tokens)
    pages = list(range(1, -(-n // PAGE) + 1))
    cache = KVCache.create(model.config, len(pages) + 2, PAGE, fill_value=float("nan"), kv_cache_dtype=kv)
    meta = dataclasses.replace(single_sequence_metadata(n, 0, pages, PAGE),
                               logits_indices=jnp.arange(n, dtype=jnp.int32))
    graphdef, state = nnx.split(model)
    logits, _ = forward_fn(graphdef, state, jnp.asarray(tokens, jnp.int32), jnp.arange(n, dtype=jnp.int32),
                           cache, meta)
    return np.asarray(logits, np.float64)


def nll(logits: np.ndarray, targets: np.ndarray) -> float:  # mean nats over rows
    m = logits.max(-1, keepdims=True)
    logz = (m[:, 0] + np.log(np.exp(logits - m).sum(-1)))
    return float(np.mean(logz - logits[np.arange(len(targets)), targets]))


def held_out_batch(seq: int = 128, rows: int = 64) -> np.ndarray:  # [rows, seq + 1]: BOS + seq bytes
    """Windows of the trained tiny model's held-out text, picked as configs/tiny/train.py evaluates."""
    train = load_train_module()
    _, held = train.load_corpus()
    starts = train.line_starts(held, seq)
    picks = starts[np.linspace(0, len(starts) - 1, rows).astype(int)]
    return train.make_batch(held, picks, seq)


def perplexity(forward_fn) -> dict:
    from jaxfill.engine.config import load_config
    from jaxfill.models.checkpoint import load_hf_params

    batch = held_out_batch()
    cfg = load_config("tiny")
    out = {}
    for wd in ("auto", "int8"):
        model = load_hf_params(cfg.model_path, dataclasses.replace(cfg.model, weight_dtype=wd), progress=False)
        losses = [nll(all_logits(forward_fn, model, row[:-1]), row[1:]) for row in batch]
        out[wd] = {"nats_per_byte": float(np.mean(losses)), "perplexity": float(np.exp(np.mean(losses)))}
    out["int8_vs_f32_perplexity_change"] = out["int8"]["perplexity"] / out["auto"]["perplexity"] - 1
    return out


def top1_agreement(forward_fn, positions: int) -> dict:
    from jaxfill.engine.config import load_config
    from jaxfill.models.checkpoint import quantize_model
    from jaxfill.models.decoder import Decoder

    train = load_train_module()
    _, held = train.load_corpus()
    f32 = Decoder(load_config("bench").model)
    int8 = quantize_model(f32)
    seq = 1024
    agree, total, kl = 0, 0, []
    for s in range(-(-positions // seq)):
        tokens = held[s * seq:(s + 1) * seq].astype(np.int32)
        a, b = all_logits(forward_fn, f32, tokens), all_logits(forward_fn, int8, tokens)
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += len(tokens)
        pa = np.exp(a - a.max(-1, keepdims=True))
        pa /= pa.sum(-1, keepdims=True)
        la = np.log(pa)
        pb = np.exp(b - b.max(-1, keepdims=True))
        lb = np.log(pb / pb.sum(-1, keepdims=True))
        kl.append(float(np.mean((pa * (la - lb)).sum(-1))))
    return {"positions": total, "top1_agreement": agree / total, "mean_kl_f32_to_int8_nats": float(np.mean(kl))}


def timed(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile + warm
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def speed(forward_fn, repeats: int) -> dict:
    from jaxfill.engine.config import load_config
    from jaxfill.models.checkpoint import quantize_model
    from jaxfill.models.kv_cache import KVCache, single_sequence_metadata
    from jaxfill.models.decoder import Decoder
    from jaxfill.models.quant import param_bytes

    f32 = Decoder(load_config("bench").model)
    models = {"auto": f32, "int8": quantize_model(f32)}
    n = 1024
    pages = list(range(1, n // PAGE + 2))
    out = {}
    for wd, model in models.items():
        graphdef, state = nnx.split(model)
        cache = KVCache.create(model.config, len(pages) + 1, PAGE, fill_value=float("nan"))
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, n), jnp.int32)
        meta = single_sequence_metadata(n, 0, pages, PAGE)
        box = {"cache": cache}

        def prefill():
            logits, box["cache"] = forward_fn(graphdef, state, tokens, jnp.arange(n, dtype=jnp.int32),
                                              box["cache"], meta)
            return logits

        t_prefill = timed(prefill, repeats)
        dmeta = single_sequence_metadata(1, n, pages, PAGE, pad_to=16)
        dtok, dpos = jnp.zeros(16, jnp.int32), jnp.full(16, n, jnp.int32)

        def decode():
            logits, box["cache"] = forward_fn(graphdef, state, dtok, dpos, box["cache"], dmeta)
            return logits

        t_decode = timed(decode, repeats)
        out[wd] = {"weight_bytes": param_bytes(state), "prefill_1024_s": t_prefill,
                   "prefill_tok_s": n / t_prefill, "decode_step_s": t_decode, "decode_tok_s_batch1": 1 / t_decode}
    return out


def matmul(repeats: int) -> dict:
    """The bench MLP up-projection [T, 512] x [512, 1408] three ways."""
    from jaxfill.models.quant import qeinsum, quantize

    rng = np.random.default_rng(0)
    w = rng.standard_normal((512, 1408)).astype(np.float32) * 0.02
    q, s = (jnp.asarray(a) for a in quantize(w, 1))
    wf = jnp.asarray(w)

    def w8a8(x, q, s):
        xs = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0
        xq = jnp.clip(jnp.rint(x / jnp.where(xs > 0, xs, 1.0)), -127, 127).astype(jnp.int8)
        acc = jax.lax.dot_general(xq, q, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
        return acc.astype(jnp.float32) * xs * s

    fns = {"f32": jax.jit(lambda x: x @ wf),
           "w8a16": jax.jit(lambda x: qeinsum("te,ei->ti", x, q, s)),
           "w8a8": jax.jit(lambda x: w8a8(x, q, s))}
    out = {}
    for t in (16, 2048):
        x = jnp.asarray(rng.standard_normal((t, 512)).astype(np.float32))
        out[f"T={t}"] = {name: timed(lambda: f(x), repeats * 4) * 1e3 for name, f in fns.items()}  # ms
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--positions", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "results", "quant_weights.json"))
    args = ap.parse_args()
    from jaxfill.models.forward import forward

    result = {"machine": f"{os.cpu_count()} CPUs", "jax": jax.__version__,
              "matmul_ms": matmul(args.repeats)}
    print(json.dumps(result["matmul_ms"]), flush=True)
    result["perplexity_tiny_heldout"] = perplexity(forward)
    print(json.dumps(result["perplexity_tiny_heldout"]), flush=True)
    result["top1_bench"] = top1_agreement(forward, args.positions)
    print(json.dumps(result["top1_bench"]), flush=True)
    result["speed_bench"] = speed(forward, args.repeats)
    print(json.dumps(result["speed_bench"]), flush=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
