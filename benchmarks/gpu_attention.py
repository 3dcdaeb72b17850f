"""Ragged paged attention on a GPU: correctness against cuDNN (or XLA), then speed.

Run by benchmarks/gpu_kernels.sh. Causal prefill at 4k / 16k / 32k tokens (one sequence)
and one mixed batch (a 2k-token prefill chunk on 6k context + 62 decodes at 4k), bf16,
Llama-3-8B attention shape (32 q heads / 8 KV heads / head_dim 128), page_size 16.
Compares impl="pallas_gpu" (Pallas Triton), impl="mosaic_gpu" (Pallas Mosaic GPU; not in
the dry run), impl="xla" (blocked pure JAX) and
jax.nn.dot_product_attention(implementation="cudnn") on contiguous K/V; prints ms,
TFLOP/s and ratios vs cuDNN, and writes $OUT/attention_gpu.json. Each impl is guarded:
a failure is reported and the rest still run, within $BUDGET_S seconds.
"""
import json, os, statistics, sys, time, traceback
import numpy as np
import jax
import jax.numpy as jnp

from jaxfill.pallas_kernels import ragged_paged_attention

# --dry-run: tiny sizes on any backend, to check this script's own logic (CI does).
DRY = "--dry-run" in sys.argv
OUT = os.environ.get("OUT") or "benchmarks/results"
if jax.default_backend() != "gpu" and not DRY:
    sys.exit(f"no GPU backend (jax sees {jax.devices()}); this script needs a CUDA GPU")
print("devices:", jax.devices(), "jax", jax.__version__, flush=True)

HQ, HKV, D, PAGE = 32, 8, 128, 16
DT = jnp.bfloat16
SCALE = D ** -0.5
DEADLINE = time.time() + float(os.environ.get("BUDGET_S", "150"))
results = {"shape": dict(hq=HQ, hkv=HKV, d=D, page_size=PAGE, dtype="bfloat16"),
           "device": str(jax.devices()[0]), "jax": jax.__version__, "cases": []}


def bench(fn, *args, reps=10, min_reps=2):
    out = fn(*args)
    jax.block_until_ready(out)  # compile + warm
    t0 = time.perf_counter(); jax.block_until_ready(fn(*args)); once = time.perf_counter() - t0
    reps = max(min_reps, min(reps, int(2.0 / max(once, 1e-6))))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), out


def rel_err(a, b):
    a = np.asarray(a, np.float32); b = np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def make_paged(key, kv_lens):
    """Random K/V for each sequence, written into shuffled pages."""
    pages_per = [-(-n // PAGE) for n in kv_lens]
    num_pages = sum(pages_per) + 1
    perm = np.random.default_rng(0).permutation(num_pages)
    max_pages = max(pages_per)
    table = np.zeros((len(kv_lens), max_pages), np.int32)
    used = 0
    for s, n in enumerate(pages_per):
        table[s, :n] = perm[used:used + n]
        used += n
    kv = jax.random.normal(key, (num_pages, PAGE, 2 * HKV, D), jnp.float32).astype(DT)
    return kv, jnp.asarray(table)


def contiguous_kv(kv_pages, table_row, n):
    kv = kv_pages[table_row].reshape(-1, 2 * HKV, D)[:n]
    return kv[:, 0::2], kv[:, 1::2]  # [n, Hkv, D]


IMPLS = {
    "pallas_gpu": jax.jit(lambda q, kv, *m: ragged_paged_attention(q, kv, *m, sm_scale=SCALE, impl="pallas_gpu")),
    "xla": jax.jit(lambda q, kv, *m: ragged_paged_attention(q, kv, *m, sm_scale=SCALE, impl="xla")),
}
if not DRY:  # the Mosaic GPU kernel (Hopper): never run on a GPU before; off a GPU it is interpreted, too slow here
    IMPLS["mosaic_gpu"] = jax.jit(lambda q, kv, *m: ragged_paged_attention(q, kv, *m, sm_scale=SCALE,
                                                                            impl="mosaic_gpu"))
cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
    q[None], k[None], v[None], is_causal=True, scale=SCALE, implementation="cudnn")[0])
xla_sdpa = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
    q[None], k[None], v[None], is_causal=True, scale=SCALE, implementation="xla")[0])


def run_case(name, q, kv_pages, kv_lens, table, cu, num_seqs, flops, contiguous=None,
             check_ref=None):
    print(f"\n== {name} ==", flush=True)
    meta = (jnp.asarray(kv_lens, jnp.int32), table, jnp.asarray(cu, jnp.int32),
            jnp.asarray([num_seqs], jnp.int32))
    row = {"case": name, "tflops_work": flops / 1e12, "impls": {}}
    ref = None
    if contiguous is not None:
        try:
            t, ref = bench(cudnn, *contiguous)
            row["impls"]["cudnn"] = {"ms": t * 1e3, "tflops": flops / t / 1e12}
        except Exception as e:  # noqa: BLE001
            row["impls"]["cudnn"] = {"error": repr(e)[:300]}
            if check_ref is not None:
                ref = check_ref()
    elif check_ref is not None:
        ref = check_ref()
    for impl, fn in IMPLS.items():
        if time.time() > DEADLINE:
            row["impls"][impl] = {"error": "skipped: time budget"}
            continue
        try:
            t, out = bench(fn, q, kv_pages, *meta, reps=3 if impl == "xla" else 10)
            r = {"ms": t * 1e3, "tflops": flops / t / 1e12}
            if ref is not None:
                r["rel_err"] = rel_err(out[: ref.shape[0]], ref)
                r["ok"] = bool(r["rel_err"] <= 2e-2 and np.isfinite(np.asarray(out, np.float32)).all())
            row["impls"][impl] = r
        except Exception as e:  # noqa: BLE001
            traceback.print_exc(limit=3)
            row["impls"][impl] = {"error": repr(e)[:300]}
    base = row["impls"].get("cudnn", {}).get("ms")
    for impl, r in row["impls"].items():
        if "ms" in r:
            extra = f"  ratio vs cudnn {r['ms'] / base:5.2f}x" if base else ""
            chk = f"  rel_err {r['rel_err']:.2e} {'OK' if r.get('ok') else 'FAIL'}" if "rel_err" in r else ""
            print(f"  {impl:11s} {r['ms']:9.2f} ms  {r['tflops']:7.1f} TFLOP/s{extra}{chk}", flush=True)
        else:
            print(f"  {impl:11s} {r['error']}", flush=True)
    results["cases"].append(row)


key = jax.random.PRNGKey(0)
for seq in ((256, 512) if DRY else (4096, 16384, 32768)):
    if time.time() > DEADLINE:
        break
    k1, k2, key = jax.random.split(key, 3)
    q = jax.random.normal(k1, (seq, HQ, D), jnp.float32).astype(DT)
    kv_pages, table = make_paged(k2, [seq])
    k, v = contiguous_kv(kv_pages, table[0], seq)
    flops = 4.0 * HQ * D * seq * (seq + 1) / 2
    # cuDNN's output is the check; the materializing XLA SDPA is the fallback only where
    # its [H, S, S] logits fit.
    run_case(f"prefill {seq} tokens", q, kv_pages, [seq], table, [0, seq], 1, flops,
             contiguous=(q, k, v),
             check_ref=(lambda: xla_sdpa(q, k, v)) if seq <= 8192 else None)

# Mixed batch: one 2048-token chunk on 6144 cached tokens + 62 decodes at 4096, padded
# to 64 sequence slots and 2176 tokens.
if time.time() < DEADLINE:
    n_dec, chunk, ctx, dec_len = (6, 64, 100, 50) if DRY else (62, 2048, 6144, 4096)
    kv_lens = [ctx + chunk] + [dec_len] * n_dec
    q_lens = [chunk] + [1] * n_dec
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    T = chunk + n_dec + 66
    k1, k2, key = jax.random.split(key, 3)
    q = jax.random.normal(k1, (T, HQ, D), jnp.float32).astype(DT)
    kv_pages, table = make_paged(k2, kv_lens + [16])
    kv_lens_p = kv_lens + [0]
    cu_p = np.concatenate([cu, [cu[-1]]])
    flops = 4.0 * HQ * D * (sum(ctx * 1 + i + 1 for i in range(chunk)) + n_dec * dec_len)
    ref_fn = lambda: ragged_paged_attention(  # noqa: E731
        q.astype(jnp.float32), kv_pages.astype(jnp.float32), jnp.asarray(kv_lens_p, jnp.int32),
        table, jnp.asarray(cu_p, jnp.int32), jnp.asarray([len(kv_lens)], jnp.int32),
        sm_scale=SCALE, impl="xla")
    run_case("mixed: 2k chunk @6k ctx + 62 decodes @4k (f32 xla as the check)", q, kv_pages,
             kv_lens_p, table, cu_p, len(kv_lens), flops, check_ref=ref_fn)

out_path = os.path.join(OUT, "attention_gpu_dry_run.json" if DRY else "attention_gpu.json")
os.makedirs(OUT, exist_ok=True)
with open(out_path, "w") as f:
    json.dump(results, f, indent=2)
bad = [(c["case"], i) for c in results["cases"] for i, r in c["impls"].items()
       if r.get("ok") is False]
print(f"\nwrote {out_path};", "FAILED checks: %s" % bad if bad else "all checks OK")
sys.exit(1 if bad else 0)
