"""Images in the prompt on CPU (issue 52): the vision encoder and the prefill of a short
text + image prompt, jaxfill vs transformers on the same random-init Qwen3-VL weights, and
what the encoder cache saves when the same image comes again.

Checkpoint (random init, f32, written once to --dir): text 4 layers, hidden 512, 8 query /
4 KV heads of 64, MLP 1536, vocab 8192; vision tower depth 4, hidden 384, 6 heads, MLP 1536,
patch 16, merge 2, DeepStack after blocks 1 and 2. Images: 448 x 448 (784 patches, 196
tokens) and 1344 x 1344 (7056 patches, 1764 tokens), random pixels, a fresh image per run
so no cache serves a timed miss. Per size, medians of --repeats runs, both sides in the
same run:
  * encoder: jaxfill's VisionTower.encode (its cache emptied) vs `model.model.visual(...)`;
  * TTFT: Engine.generate(max_tokens=1) with prefix caching off vs one transformers forward
    of the expanded prompt (same first token checked);
  * hit: the same prompt and image again: TTFT and the encoder runs it adds (0: a hit).
Writes benchmarks/results/vision_prefill.json.

    python benchmarks/vision_prefill.py [--repeats 3] [--dir /tmp/vision_prefill_ckpt]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGE, VIDEO, START, END = 8000, 8001, 8002, 8003
TEXT = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [12, 10, 10],
                             "mrope_interleaved": True})
VISION = dict(depth=4, hidden_size=384, intermediate_size=1536, num_heads=6, out_hidden_size=512, patch_size=16,
              temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_position_embeddings=2304,
              deepstack_visual_indexes=[1, 2])
SIDES = (448, 1344)


def checkpoint(directory: str) -> str:
    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    import torch
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration
    torch.manual_seed(0)
    config = Qwen3VLConfig(text_config=TEXT, vision_config=VISION, image_token_id=IMAGE, video_token_id=VIDEO,
                           vision_start_token_id=START, vision_end_token_id=END, tie_word_embeddings=False)
    Qwen3VLForConditionalGeneration(config).eval().save_pretrained(directory)
    Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                             image_std=[0.5] * 3, size={"shortest_edge": 56 * 56, "longest_edge": 2048 * 2048},
                             ).save_pretrained(directory)
    return directory


def prompt() -> list[int]:  # a short chat-like text around one image
    return list(range(100, 112)) + [START, IMAGE, END] + list(range(200, 220))


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/vision_prefill_ckpt")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "vision_prefill.json"))
    args = ap.parse_args()
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    from jaxfill import Engine
    from jaxfill.engine.config import load_config
    from jaxfill.engine.request import SamplingParams
    from jaxfill.engine.vision.image_processor import image_batch

    ckpt = checkpoint(args.dir)
    torch.set_num_threads(os.cpu_count() or 1)
    hf = Qwen3VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    over = {"engine.max_model_len": 2048, "engine.num_pages": 160, "engine.max_num_seqs": 2,
            "engine.max_num_batched_tokens": 2048, "engine.token_buckets": [64, 256, 2048],
            "engine.enable_prefix_caching": False}
    engine = Engine(load_config("tiny_random", over, ckpt), progress=False)
    tower = engine.runner.vision
    rng = np.random.default_rng(0)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    load = os.getloadavg()
    rows = []
    for side in SIDES:
        fresh = lambda: rng.integers(0, 256, (side, side, 3), np.uint8)  # noqa: E731
        ids = prompt()
        _, images = tower.expand(ids, [fresh()])
        span = images.spans[0]
        m = {"side": side, "patches": int(span.pixels.shape[0]), "image_tokens": int(span.length)}
        t = {k: [] for k in ("enc_jax", "enc_hf", "ttft_jax", "ttft_hf", "ttft_hit_jax")}
        hit_runs, same_token = [], []
        print(f"{side}x{side}: warm-up (compile)", flush=True)
        tower.encode(span)
        engine.generate([{"prompt": ids, "images": [fresh()]}], one)
        for r in range(args.repeats):
            img = fresh()
            expanded, images = tower.expand(ids, [img])
            span = images.spans[0]
            tower.cache.clear()
            t["enc_jax"].append(timed(lambda: tower.encode(span))[0])
            pixels, grids = image_batch([img], tower.settings)
            pv, thw = torch.from_numpy(pixels), torch.tensor(grids)
            with torch.no_grad():
                t["enc_hf"].append(timed(lambda: hf.model.visual(pv, grid_thw=thw))[0])
            tower.cache.clear()
            req = {"prompt": ids, "images": [img]}
            dt, out = timed(lambda: engine.generate([req], one))
            t["ttft_jax"].append(dt)
            misses = engine.stats()["encoder_cache_misses"]
            dt, again = timed(lambda: engine.generate([req], one))
            t["ttft_hit_jax"].append(dt)
            hit_runs.append(engine.stats()["encoder_cache_misses"] - misses)
            inp = torch.tensor([expanded])
            with torch.no_grad():
                dt, logits = timed(lambda: hf(input_ids=inp, pixel_values=pv, image_grid_thw=thw,
                                              mm_token_type_ids=(inp == IMAGE).int()).logits)
            t["ttft_hf"].append(dt)
            same_token.append(out[0].token_ids[0] == again[0].token_ids[0] == int(logits[0, -1].argmax()))
            print(f"  run {r + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1] * 1e3:.0f} ms" for k, v in t.items()),
                  flush=True)
        m.update({k: statistics.median(v) * 1e3 for k, v in t.items()})
        m.update(prompt_rows=len(expanded), encoder_runs_on_hit=max(hit_runs), same_first_token=all(same_token))
        rows.append(m)
    result = {"load_before": load, "load_after": os.getloadavg(), "repeats": args.repeats, "text": TEXT,
              "vision": VISION, "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("| image | patches | tokens | encoder jaxfill | encoder HF | TTFT jaxfill | TTFT HF | TTFT same image "
          "(hit) | encoder runs on hit | same token |")
    for m in rows:
        print(f"| {m['side']}x{m['side']} | {m['patches']} | {m['image_tokens']} | {m['enc_jax']:.0f} | "
              f"{m['enc_hf']:.0f} | {m['ttft_jax']:.0f} | {m['ttft_hf']:.0f} | {m['ttft_hit_jax']:.0f} | "
              f"{m['encoder_runs_on_hit']} | {m['same_first_token']} |")
    print(f"load average {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after", file=sys.stderr)


if __name__ == "__main__":
    main()
