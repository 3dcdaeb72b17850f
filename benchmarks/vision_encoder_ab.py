"""Issue 52: the Qwen3-VL encoder with the blocked segment attention (models/vision/attention.py)
and 4 patch buckets per octave (engine/vision/tower.py) vs the dense attention it replaced
(f32 scores [H, N, N]) and power-of-two buckets, alternating in one process on the same
weights and images (vision_prefill.py's checkpoint; run that first to write it).

    python benchmarks/vision_encoder_ab.py [--repeats 5] [--dir /tmp/vision_prefill_ckpt]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dense(q, k, v, segments, scale):  # [N, H, D] x3, [N]: the attention before issue 52's change
    scores = jnp.einsum("qhd,khd->hqk", q, k) * scale
    scores = jnp.where((segments[:, None] == segments[None, :])[None], scores.astype(jnp.float32), -jnp.inf)
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, -1).astype(v.dtype), v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/vision_prefill_ckpt")
    ap.add_argument("--sides", type=int, nargs="+", default=[448, 1344])
    args = ap.parse_args()
    from jaxfill.engine.vision import tower as tower_mod
    from jaxfill.engine.vision.image_processor import image_settings
    from jaxfill.models.vision import qwen3_vl
    from jaxfill.models.vision.config import vision_config
    from jaxfill.models.vision.weights import load_encoder

    with open(os.path.join(args.dir, "config.json")) as f:
        hf = json.load(f)
    blocked_attention, bucket = qwen3_vl.segment_attention, tower_mod.patch_bucket
    # the two variants pad to different row counts, so each compiles its own program of _encode
    tower = tower_mod.VisionTower(load_encoder(args.dir, vision_config(hf)), image_settings(args.dir, hf["vision_config"]),
                                  int(hf["image_token_id"]))
    variants = {"blocked": (blocked_attention, bucket),
                "dense": (dense, lambda n: max(64, 1 << (n - 1).bit_length()))}
    rng = np.random.default_rng(0)
    rows = []
    for side in args.sides:
        t = {name: [] for name in variants}
        outs = {}
        for r in range(args.repeats + 1):  # the first round compiles
            img = rng.integers(0, 256, (side, side, 3), np.uint8)
            _, images = tower.expand([tower.image_token_id], [img])
            span = images.spans[0]
            assert bucket(span.pixels.shape[0]) != variants["dense"][1](span.pixels.shape[0]), "same rows: one program"
            for name, (attn, buck) in (variants.items() if r % 2 else reversed(variants.items())):
                qwen3_vl.segment_attention, tower_mod.patch_bucket = attn, buck
                start = time.perf_counter()
                outs[name] = tower._encode(span)[0]
                if r:
                    t[name].append(time.perf_counter() - start)
        err = float(np.abs(outs["blocked"] - outs["dense"]).max() / np.abs(outs["dense"]).max())
        m = {"side": side, "patches": int(span.pixels.shape[0]), "rows_blocked": bucket(span.pixels.shape[0]),
             "rows_dense": variants["dense"][1](span.pixels.shape[0]), "rel_err_last_run": err}
        m.update({f"{k}_ms": statistics.median(v) * 1e3 for k, v in t.items()})
        m.update({f"{k}_runs_ms": [round(x * 1e3) for x in v] for k, v in t.items()})
        print(m, flush=True)
        rows.append(m)
    out = os.path.join(ROOT, "benchmarks", "results", "vision_encoder_ab.json")
    with open(out, "w") as f:
        json.dump({"load": os.getloadavg(), "repeats": args.repeats, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
