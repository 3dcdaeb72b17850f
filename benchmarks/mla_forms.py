"""MLA's absorbed vs expanded form (issue 26): where the expanded form starts to pay.

    python benchmarks/mla_forms.py [--heads 8] [--prefixes 0 512 2048] [--chunks 16 64 128 256 512]
    python benchmarks/mla_forms.py --replot

One attention layer's `LatentAttention._attend` (models/mixers/mla.py; the K/V projections and
the rest of the layer are the same in both forms), jitted once per (form, prefix, chunk),
DeepSeek V3's head dims (kv_lora_rank 512, rope 64, nope 128, v 128) with `--heads` heads
(V3's 128 over tensor = 16 is 8 per device), f32, attention impl xla, page size 16. One
sequence: a `chunk`-token prefill over a `prefix`-token cached context. Also decode: 8
sequences of one token over `prefix` tokens each. Each point: compile + one warm-up
excluded, median of --repeats; the forms alternate per repeat, so both see the same load.
Next to each measurement: what `prefers_expanded` (the multiply-add count the engine's
"auto" uses) picks for that batch.

Writes benchmarks/results/mla_forms.json and mla_forms.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
DIMS = dict(lat=512, rope=64, nope=128, vd=128)
PAGE = 16


def layer(form: str, heads: int):
    from flax import nnx

    from jaxfill.models.config import ModelConfig
    from jaxfill.models.mixers.mla import LatentAttention

    d = DIMS
    cfg = ModelConfig.of(architecture="DeepseekV3ForCausalLM", hidden_size=256, num_heads=heads, num_kv_heads=1,
                      head_dim=d["lat"] + d["rope"], rotary_dim=d["rope"], kv_lora_rank=d["lat"],
                      qk_rope_head_dim=d["rope"], qk_nope_head_dim=d["nope"], v_head_dim=d["vd"], mla_form=form)
    return LatentAttention(cfg, nnx.Rngs(0))


def batch(q_lens: list[int], kv_lens: list[int], heads: int, rng):
    import jax.numpy as jnp
    import numpy as np

    from jaxfill.models.kv_cache import AttentionMetadata

    per = [-(-n // PAGE) for n in kv_lens]
    width = max(per)
    table = np.zeros((len(q_lens), width), np.int32)
    nxt = 0
    for s, n in enumerate(per):
        table[s, :n] = np.arange(nxt, nxt + n)
        nxt += n
    d = DIMS
    pages = rng.standard_normal((nxt, PAGE, 1, d["lat"] + d["rope"]), np.float32)
    t = sum(q_lens)
    meta = AttentionMetadata(cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
                             kv_lens=jnp.asarray(kv_lens, jnp.int32), page_indices=jnp.asarray(table),
                             num_seqs=jnp.asarray([len(q_lens)], jnp.int32),
                             slot_mapping=jnp.full((t,), -1, jnp.int32),
                             logits_indices=jnp.asarray(np.cumsum(q_lens) - 1, jnp.int32))
    q = jnp.asarray(rng.standard_normal((t, heads, d["nope"] + d["rope"]), np.float32))
    w = rng.standard_normal((heads, d["lat"], d["nope"] + d["vd"]), np.float32) / 16
    return q, jnp.asarray(pages), meta, jnp.asarray(w[..., :d["nope"]]), jnp.asarray(w[..., d["nope"]:])


def measure(q_lens, kv_lens, heads, repeats, rng) -> dict:
    import jax

    from jaxfill.models.mixers.mla_expanded import prefers_expanded

    q, pages, meta, w_uk, w_uv = batch(q_lens, kv_lens, heads, rng)
    fns = {}
    for form in ("absorbed", "expanded"):
        attn = layer(form, heads)
        fns[form] = jax.jit(lambda q, pages, meta, w_uk, w_uv, attn=attn: attn._attend(q, pages, meta, w_uk, w_uv, "xla"))
        for _ in range(2):  # compile, warm-up
            fns[form](q, pages, meta, w_uk, w_uv).block_until_ready()
    times = {form: [] for form in fns}
    for i in range(repeats):
        for form in (("absorbed", "expanded") if i % 2 == 0 else ("expanded", "absorbed")):
            t = time.perf_counter()
            fns[form](q, pages, meta, w_uk, w_uv).block_until_ready()
            times[form].append(time.perf_counter() - t)
    med = {form: statistics.median(ts) for form, ts in times.items()}
    cap = len(q_lens) * meta.page_indices.shape[1]
    model = bool(prefers_expanded(meta, PAGE, cap, **DIMS))
    return {"q_lens": q_lens, "kv_lens": kv_lens, "times_s": times, "absorbed_s": med["absorbed"],
            "expanded_s": med["expanded"], "absorbed_over_expanded": med["absorbed"] / med["expanded"],
            "measured_faster": "expanded" if med["expanded"] < med["absorbed"] else "absorbed",
            "auto_picks": "expanded" if model else "absorbed"}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for prefix in result["prefixes"]:
        rows = [r for r in result["rows"] if r["kind"] == "chunk" and r["prefix"] == prefix]
        ax.plot([r["chunk"] for r in rows], [r["absorbed_over_expanded"] for r in rows], "o-",
                label=f"prefix {prefix}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("chunk tokens (one sequence)")
    ax.set_ylabel("absorbed time / expanded time (median)")
    ax.set_title(f"MLA layer, V3 head dims, {result['heads']} heads, f32, XLA:CPU (2 cores, noisy)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--prefixes", type=int, nargs="+", default=[0, 512, 2048])
    p.add_argument("--chunks", type=int, nargs="+", default=[16, 64, 128, 256, 512])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--replot", action="store_true")
    p.add_argument("--out", default=os.path.join(RESULTS, "mla_forms.json"))
    args = p.parse_args()
    png = os.path.splitext(args.out)[0] + ".png"
    if args.replot:
        with open(args.out) as f:
            return plot(json.load(f), png)
    import jax
    import numpy as np

    rng = np.random.default_rng(0)
    load_start, t0 = os.getloadavg(), time.time()
    rows = []
    points = [("decode", prefix, 1) for prefix in args.prefixes if prefix] + \
             [("chunk", prefix, chunk) for prefix in args.prefixes for chunk in args.chunks]
    for i, (kind, prefix, chunk) in enumerate(points):
        q_lens, kv_lens = ([1] * 8, [prefix + 1] * 8) if kind == "decode" else ([chunk], [prefix + chunk])
        r = {"kind": kind, "prefix": prefix, "chunk": chunk,
             **measure(q_lens, kv_lens, args.heads, args.repeats, rng)}
        rows.append(r)
        print(f"[{i + 1}/{len(points)}] {kind} prefix={prefix} chunk={chunk}: absorbed {r['absorbed_s'] * 1e3:.1f} ms, "
              f"expanded {r['expanded_s'] * 1e3:.1f} ms, auto picks {r['auto_picks']} "
              f"({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "jax": jax.__version__, "cpu_count": os.cpu_count(),
              "heads": args.heads, "dims": DIMS, "page_size": PAGE, "prefixes": args.prefixes,
              "repeats": args.repeats, "rows": rows, "wall_s": time.time() - t0,
              "load_average_start": load_start, "load_average_end": os.getloadavg()}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, png)


if __name__ == "__main__":
    main()
