"""`jaxfill bench prefill`: measured TTFT per prompt length and chunk size vs the planner.

One prompt at a time through `engine.simple.prefill_chunks` (the jitted
`models.forward.forward`) on a KVCache sized for the prompt. Per (length, chunk): warm-up
runs (compile), then the median of `--repeats` timed runs, each ended by
`block_until_ready` on the logits. Reported beside each: prefill tokens/s, achieved
FLOP/s (the planner's causal FLOP count / TTFT), the planner's TTFT floor on
`--hardware` and measured/floor, KV bytes the cache really allocates vs the formula, and
the measured TTFT(2N)/TTFT(N). Writes JSON and PNGs (matplotlib, Agg) under `--out`.

With `--hardware cpu` the machine is measured (XLA matmul at the model's MLP shape and
dtype, streaming bandwidth) before and after the timings; the prediction uses the mean,
so a neighbour loading the machine for part of the run moves both sides.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

COMMAND = ("bench", "prefill")
HELP = "measure prefill TTFT per prompt length and chunk size; compare with the planner"

DEFAULT_LENGTHS = (256, 512, 1024, 2048)


def add_arguments(p) -> None:
    from jaxfill.serving.cli import common_model_args

    common_model_args(p)
    p.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS), metavar="N",
                   help=f"prompt lengths (default: {' '.join(map(str, DEFAULT_LENGTHS))})")
    p.add_argument("--chunk-sizes", type=int, nargs="+", default=[0], metavar="C",
                   help="prefill chunk sizes; 0 = whole prompt in one step (default: 0)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point; the median is reported")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per point (the first compiles)")
    from jaxfill.engine.planner.hardware import hardware_help

    p.add_argument("--hardware", default=None,
                   help=f"planner hardware for the predicted floor (default on a CPU backend: cpu): "
                        f"{hardware_help()}, or 'none'")
    p.add_argument("--out", default=None,
                   help="directory for JSON and PNGs (default: a new jaxfill-bench/prefill-<time>/)")
    p.add_argument("--name", default=None, help="file name stem (default: prefill_bench_<config>)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    p.add_argument("--seed", type=int, default=0, help="prompt token seed")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def time_prefill(model, prompt: list[int], page_size: int, chunk: int | None, repeats: int,
                 warmup: int, probe=None) -> tuple[list[float], list[float], int, int]:
    """Timed prefills of `prompt`; returns (seconds per run, probe FLOP/s per run, cache
    bytes, cache slots). `probe()`, when given, runs right before and right after each
    timed run; the run's rate is the mean of the two."""
    import jax

    from jaxfill.engine.simple import prefill_chunks
    from jaxfill.models.kv_cache import KVCache

    n_pages = -(-len(prompt) // page_size)
    cache = KVCache.create(model.config, n_pages + 1, page_size)  # + the null page 0
    nbytes, slots = cache.nbytes(), cache.num_pages * cache.page_size
    pages = list(range(1, n_pages + 1))
    times, rates = [], []
    for i in range(warmup + repeats):
        before = probe() if i >= warmup and probe is not None else None
        start = time.perf_counter()
        logits, cache = prefill_chunks(model, prompt, cache, pages, chunk)
        jax.block_until_ready(logits)
        if i >= warmup:
            times.append(time.perf_counter() - start)
            if probe is not None:
                rates.append((before + probe()) / 2)
    jax.block_until_ready(cache)
    return times, rates, nbytes, slots


def run_bench(config, lengths: list[int], chunk_sizes: list[int], repeats: int = 3, warmup: int = 1,
              hardware: str | None = "cpu", seed: int = 0, progress: bool = True) -> dict:
    import jax
    import numpy as np

    import dataclasses

    from jaxfill.engine.planner.hardware import MatmulProbe, load_hardware
    from jaxfill.engine.loading import build_model
    from jaxfill.engine.planner.plan import check_mesh, model_matmul_shape, ttft_floor
    from jaxfill.engine.planner.counts import check_prompt_len, kv_bytes_per_token, prefill_flops
    from jaxfill.pallas_kernels import resolve_impl

    log = _log if progress else (lambda msg: None)
    m, eng = config.model, config.engine
    if config.mesh.size != 1:
        raise ValueError("bench prefill runs on one device; leave mesh.* at 1 (use `jaxfill plan` for meshes)")
    check_mesh(m, config.mesh)
    if repeats < 1 or warmup < 0:
        raise ValueError("--repeats must be >= 1 and --warmup >= 0")
    for n in lengths:
        check_prompt_len(n, eng)
    for c in chunk_sizes:
        if c < 0:
            raise ValueError(f"chunk sizes must be >= 0 (0 = whole prompt), got {c}")
    hw_name = None if (hardware or "").lower() == "none" else hardware

    def measure_hw(when: str):
        if hw_name is None:
            return None
        if hw_name.lower() == "cpu":  # a table entry is read, not measured
            log(f"measuring this CPU {when}...")
        return load_hardware(hw_name, m.dtype, model_matmul_shape(m))

    hw_before = measure_hw("before the timed runs")
    # On a CPU (often shared), a short matmul probe around every timed run records how
    # much of the machine the run got; each run is compared with the floor at that rate.
    probe = None
    if hw_before is not None and hw_before.shared_by_mesh:
        matmul = MatmulProbe(m.dtype, model_matmul_shape(m))
        probe = lambda: matmul(repeats=3)  # noqa: E731
    from jaxfill.models.families.registry import param_count

    log(f"building model {config.name} ({param_count(m) / 1e6:.1f}M params, {m.dtype})"
        + (f" from {config.model_path}" if config.model_path else ", random init"))
    model = build_model(config, progress=False)
    rng = np.random.default_rng(seed)
    prompt_all = rng.integers(0, m.vocab_size, size=max(lengths)).tolist()
    points = []
    grid = [(n, c) for c in sorted(set(chunk_sizes)) for n in sorted(set(lengths))]
    for n, c in grid:
        if c >= n and 0 in chunk_sizes:
            log(f"skipped len={n} chunk={c}: chunk >= prompt length (the same run as chunk=whole)")
    grid = [(n, c) for n, c in grid if c == 0 or c < n or (c >= n and 0 not in chunk_sizes)]
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    for i, (n, c) in enumerate(grid):
        label = f"[{i + 1}/{len(grid)}] len={n} chunk={c or 'whole'}"
        log(f"{label}: {warmup} warm-up + {repeats} timed runs...")
        times, rates, nbytes, slots = time_prefill(model, prompt_all[:n], eng.page_size, c or None,
                                                   repeats, warmup, probe)
        med = statistics.median(times)
        log(f"{label}: median {med * 1e3:.1f} ms ({n / med:,.0f} tok/s); runs "
            + " ".join(f"{t * 1e3:.0f}" for t in times) + f" ms; elapsed {time.perf_counter() - t_start:.0f}s")
        points.append({"prompt_len": n, "chunk": c, "times_s": times, "probe_flops_per_s": rates, "ttft_s": med,
                       "tokens_per_s": n / med, "flops": prefill_flops(m, n),
                       "achieved_flops_per_s": prefill_flops(m, n) / med,
                       "kv_cache_bytes": nbytes, "kv_cache_slots": slots,
                       "kv_bytes_per_token_allocated": nbytes / slots})
    hw_after = measure_hw("after the timed runs (the session's bandwidth is the mean of both)")
    hw = hw_before
    if probe is not None:  # session figures: median probe rate, mean of the two bandwidths
        all_rates = sorted(r for p in points for r in p["probe_flops_per_s"])
        peak = all_rates[len(all_rates) // 2]
        bw = (hw_before.hbm_bytes_per_s + hw_after.hbm_bytes_per_s) / 2
        hw = dataclasses.replace(hw_before, bf16_flops=peak, fp32_flops=peak, hbm_bytes_per_s=bw,
                                 link_bytes_per_s=bw, source=hw_before.source + "; peak = median of "
                                 "the matmul probes run around every timed run")
    per_token = kv_bytes_per_token(m)
    for p in points:
        p["kv_bytes_per_token_formula"] = per_token
        if hw is None:
            continue
        n, c = p["prompt_len"], p["chunk"] or None
        if probe is not None:
            def floor_at(rate):
                return ttft_floor(m, config.mesh, dataclasses.replace(hw, bf16_flops=rate, fp32_flops=rate), n, c)
            rate = statistics.median(p["probe_flops_per_s"])
            floor = floor_at(rate)
            ratios = [t / floor_at(r) for t, r in zip(p["times_s"], p["probe_flops_per_s"])]
            p["ttft_over_floor_per_run"] = ratios
            ratio = statistics.median(ratios)
        else:
            floor = ttft_floor(m, config.mesh, hw, n, c)
            ratio = p["ttft_s"] / floor
        p["ttft_floor_s"] = floor
        p["ttft_over_floor"] = ratio
        if ratio < 1:
            log(f"len={n} chunk={c or 'whole'}: measured TTFT is {ratio:.2f}x the planner's floor: the "
                "hardware figures under-measure this machine (shared CPU?), so this floor is not a floor")
        p["prediction_error"] = 1.0 / ratio - 1.0  # (floor - measured) / measured
    whole = {p["prompt_len"]: p["ttft_s"] for p in points if p["chunk"] == 0}
    decay = [{"prompt_len": n, "measured": whole[2 * n] / whole[n],
              **({"predicted": ttft_floor(m, config.mesh, hw, 2 * n) / ttft_floor(m, config.mesh, hw, n)}
                 if hw is not None else {})}
             for n in sorted(whole) if 2 * n in whole]
    return {
        "config": config.name, "model_path": config.model_path, "dtype": m.dtype,
        "attention_impl": resolve_impl(eng.attention_impl), "page_size": eng.page_size,
        "repeats": repeats, "warmup": warmup,
        "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
        "machine": {"cpu_count": os.cpu_count(), "platform": sys.platform},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        # Other jobs on the machine (1/5/15-minute load averages) when the timings ran.
        "load_average_start": load_start, "load_average_end": os.getloadavg(),
        "hardware": hw.to_dict() if hw else None,
        "hardware_before": hw_before.to_dict() if hw_before else None,
        "hardware_after": hw_after.to_dict() if hw_after else None,
        "points": points, "decay": decay,
    }


def print_table(result: dict) -> None:
    from jaxfill.serving.commands.plan import _si, format_table

    rows = []
    for p in result["points"]:
        rows.append({
            "len": p["prompt_len"], "chunk": p["chunk"] or "whole", "ttft": f"{p['ttft_s'] * 1e3:.1f} ms",
            "tok/s": f"{p['tokens_per_s']:,.0f}", "FLOP/s": _si(p["achieved_flops_per_s"]),
            "floor": f"{p['ttft_floor_s'] * 1e3:.1f} ms" if "ttft_floor_s" in p else "-",
            "meas/floor": f"{p['ttft_over_floor']:.2f}" if "ttft_over_floor" in p else "-",
            "KV B/tok alloc": f"{p['kv_bytes_per_token_allocated']:.0f}",
            "KV B/tok formula": str(p["kv_bytes_per_token_formula"]),
        })
    cols = [(k, k, str) for k in rows[0]] if rows else []
    print(format_table(rows, cols))
    for d in result["decay"]:
        pred = f", predicted {d['predicted']:.2f}" if "predicted" in d else ""
        print(f"TTFT({2 * d['prompt_len']})/TTFT({d['prompt_len']}): measured {d['measured']:.2f}{pred}")
    hw = result.get("hardware")
    if hw:
        print(f"hardware {hw['name']}: {_si(hw['fp32_flops'] if result['dtype'] == 'float32' else hw['bf16_flops'], 'FLOP/s')}"
              f" matmul, {_si(hw['hbm_bytes_per_s'], 'B/s')} memory ({hw['source']})")


def plot(result: dict, out_dir: str, stem: str, cfg) -> list[str]:
    """PNGs: TTFT vs length (measured, planner floor), tokens/s vs length, chunk sweep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from jaxfill.engine.planner.hardware import Hardware
    from jaxfill.engine.planner.plan import ttft_floor

    paths = []
    pts = result["points"]
    whole = sorted((p for p in pts if p["chunk"] == 0), key=lambda p: p["prompt_len"])
    hw = Hardware(**result["hardware"]) if result.get("hardware") else None
    title = f"{result['config']} {result['dtype']}, attention={result['attention_impl']}, {result['date'][:10]}"

    def dense(lo, hi):
        import numpy as np
        return sorted(set(int(x) for x in np.geomspace(lo, hi, 40)))

    if whole:
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        ax.plot([p["prompt_len"] for p in whole], [p["ttft_s"] for p in whole], "o-", label="measured (median)")
        if hw:
            xs = dense(whole[0]["prompt_len"], whole[-1]["prompt_len"])
            ax.plot(xs, [ttft_floor(cfg.model, cfg.mesh, hw, x) for x in xs], "--",
                    label=f"planner floor ({hw.name})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"Prefill TTFT\n{title}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        paths.append(os.path.join(out_dir, f"{stem}_ttft.png"))
        fig.tight_layout()
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        ax.plot([p["prompt_len"] for p in whole], [p["tokens_per_s"] for p in whole], "o-", label="measured")
        if hw:
            ax.plot(xs, [x / ttft_floor(cfg.model, cfg.mesh, hw, x) for x in xs], "--",
                    label=f"planner ceiling ({hw.name})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("prefill tokens/s")
        ax.set_ylim(bottom=0)
        ax.set_title(f"Prefill throughput\n{title}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend()
        paths.append(os.path.join(out_dir, f"{stem}_tokens_per_s.png"))
        fig.tight_layout()
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    chunked = [p for p in pts if p["chunk"]]
    if chunked:
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        for n in sorted({p["prompt_len"] for p in chunked}):
            row = sorted((p for p in pts if p["prompt_len"] == n and p["chunk"]), key=lambda p: p["chunk"])
            xs = [p["chunk"] for p in row] + ([n] if any(p["prompt_len"] == n for p in whole) else [])
            ys = [p["ttft_s"] for p in row] + [p["ttft_s"] for p in whole if p["prompt_len"] == n]
            line, = ax.plot(xs, ys, "o-", label=f"{n} tokens")
            if hw:
                ax.plot(xs, [ttft_floor(cfg.model, cfg.mesh, hw, n, c) for c in xs], "--",
                        color=line.get_color(), alpha=0.6)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("chunk size (tokens; rightmost = whole prompt)")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"Chunked prefill: TTFT vs chunk size (dashed: planner floor)\n{title}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        paths.append(os.path.join(out_dir, f"{stem}_chunks.png"))
        fig.tight_layout()
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def run(args) -> int:
    import jax

    from jaxfill.engine.config import load_config
    from jaxfill.serving.bench_output import PLOTS_HINT, fresh_results_dir, have_matplotlib

    config = load_config(args.config, overrides=args.overrides, model_path=args.model)
    hardware = args.hardware or ("cpu" if jax.default_backend() == "cpu" else "none")
    result = run_bench(config, args.lengths, args.chunk_sizes, args.repeats, args.warmup, hardware, args.seed)
    print_table(result)
    out = args.out or fresh_results_dir("prefill")
    os.makedirs(out, exist_ok=True)
    stem = args.name or f"prefill_bench_{config.name}"
    path = os.path.join(out, f"{stem}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    plots = not args.no_plots and have_matplotlib()
    if not args.no_plots and not plots:
        _log(PLOTS_HINT + "; skipping the PNGs")
    written = [path] + (plot(result, out, stem, config) if plots else [])
    _log("wrote " + ", ".join(written))
    return 0
