"""`jaxfill plan`: prefill cost, KV footprint and TTFT floor from model shape, mesh and hardware."""

from __future__ import annotations

import json
import sys

COMMAND = ("plan",)
HELP = "prefill FLOPs, KV bytes, TTFT floor and capacity for a config on given hardware"


def add_arguments(p) -> None:
    from jaxfill.serving.cli import common_model_args

    common_model_args(p)
    from jaxfill.engine.planner.hardware import hardware_help

    p.add_argument("--hardware", default="h100_sxm",
                   help=f"an entry of configs/hardware.toml or 'cpu': {hardware_help()} (default: h100_sxm)")
    p.add_argument("--prompt-len", dest="prompt_lens", type=int, action="append", default=None,
                   metavar="N", help="prompt length in tokens (repeatable; default: 128, 512, 2048, ... "
                                     "below engine.max_model_len)")
    p.add_argument("--link-gbps", type=float, default=None, metavar="G",
                   help="prefill-to-decode link in Gbit/s: adds the KV bytes a disaggregated request "
                        "moves and their transfer time (kv_transfer_bytes, kv_transfer_s)")
    p.add_argument("--activation-bytes", type=int, default=0, metavar="B",
                   help="per-device activation peak the KV pool leaves free (engine.num_pages=0 "
                        "measures it at start-up as the compiled step's temp bytes; default 0)")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt length on stdout")


def _si(x: float, unit: str = "") -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _bytes(x: float) -> str:
    for scale, prefix in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}"
    return f"{x:.0f} B"


def _seconds(x: float) -> str:
    if x >= 1:
        return f"{x:.3g} s"
    if x >= 1e-3:
        return f"{x * 1e3:.3g} ms"
    return f"{x * 1e6:.3g} us"


def format_table(rows: list[dict], columns: list[tuple[str, str, callable]]) -> str:
    cells = [[h for h, _, _ in columns]] + [[fmt(r[k]) for _, k, fmt in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


PLAN_COLUMNS = [
    ("prompt", "prompt_len", str),
    ("FLOPs", "prefill_flops", lambda x: _si(x)),
    ("matmul", "matmul_flops", lambda x: _si(x)),
    ("attention", "attention_flops", lambda x: _si(x)),
    ("KV/request", "kv_bytes_per_request", _bytes),
    ("pages", "pages_per_request", str),
    ("KV/device", "kv_bytes_per_device", _bytes),
    ("fits", "fits", lambda x: "yes" if x else "NO"),
    ("bound", "bound", str),
    ("collective", "collective_s", _seconds),
    ("TTFT floor", "ttft_floor_s", _seconds),
    ("tok/s ceil", "tokens_per_s_ceiling", lambda x: _si(x)),
    ("fit", "max_concurrent_requests", str),
    ("TTFT(2N)/TTFT(N)", "decay_coefficient", lambda x: f"{x:.2f}"),
]

CONTEXT_COLUMNS = [
    ("ring", "ring_mode", str),
    ("pass-Q bytes", "pass_q_collective_bytes_per_device", _bytes),
    ("pass-KV bytes", "pass_kv_collective_bytes_per_device", lambda x: _bytes(x) if x is not None else "-"),
]

STAGE_COLUMNS = [
    ("microbatches", "microbatches", str),
    ("bubble", "bubble_fraction", lambda x: f"{x:.2g}"),
    ("stage xfer", "stage_transfer_s", _seconds),
]

TRANSFER_COLUMNS = [
    ("KV moved", "kv_transfer_bytes", _bytes),
    ("transfer", "kv_transfer_s", _seconds),
    ("transfer/TTFT", "kv_transfer_over_ttft_floor", lambda x: f"{x:.2g}"),
]


def _stretched(config, lens: list[int]):
    """A prompt past engine.max_model_len or the model's positions is still planned (the
    cost of the shape: a million-token question deserves its answer), with both limits
    raised to a power of two above it and a warning that says which limit it passed."""
    import dataclasses

    longest = max(lens)
    if longest <= 0 or longest < config.engine.max_model_len:
        return config
    m, e = config.model, config.engine
    n = 1 << longest.bit_length()
    past = (f"the model's max_position_embeddings={m.max_position_embeddings} (rope_theta {m.attention.rope_theta:g}, "
            f"rope_scaling {m.attention.rope_scaling_dict or 'none'}: its rope was not trained that far)"
            if longest >= m.max_position_embeddings else f"engine.max_model_len={e.max_model_len}")
    print(f"warning: prompt length {longest} is past {past}; planned with model.max_position_embeddings="
          f"{max(n, m.max_position_embeddings)} and engine.max_model_len={n}: the cost of the shape, not a "
          f"claim about the model at that length", file=sys.stderr, flush=True)
    model = dataclasses.replace(m, max_position_embeddings=max(n, m.max_position_embeddings))
    return dataclasses.replace(config, model=model, engine=dataclasses.replace(e, max_model_len=n))


def run(args) -> int:
    from jaxfill.engine.config import load_config
    from jaxfill.engine.planner.hardware import load_hardware
    from jaxfill.engine.planner.plan import check_mesh, default_prompt_lens, kv_pool_pages, model_matmul_shape, plan
    from jaxfill.models.families.registry import active_param_count, param_count
    from jaxfill.engine.planner.counts import check_link_gbps, check_prompt_len

    config = load_config(args.config, overrides=args.overrides, model_path=args.model)
    check_mesh(config.model, config.mesh)
    check_link_gbps(args.link_gbps)
    lens = args.prompt_lens or default_prompt_lens(config.engine)
    config = _stretched(config, lens)  # validate before measuring the CPU
    for n in lens:
        check_prompt_len(n, config.engine, config.model)
    if args.hardware.lower() == "cpu" and not args.json:
        print("measuring this CPU (XLA matmul + streaming bandwidth)...", file=sys.stderr, flush=True)
    hw = load_hardware(args.hardware, config.model.dtype, model_matmul_shape(config.model))
    rows = plan(config, hw, lens, args.link_gbps)
    pool = kv_pool_pages(config, hw, args.activation_bytes)  # what engine.num_pages=0 would allocate
    mesh = config.mesh
    if args.json:
        for row in rows:
            print(json.dumps({"config": config.name, "hardware": hw.name, "dtype": config.model.dtype,
                              "mesh": {"data": mesh.data, "tensor": mesh.tensor, "expert": mesh.expert,
                                       "sequence": mesh.sequence, "stage": mesh.stage,
                                       "microbatches": mesh.microbatches},
                              "params": param_count(config.model), "active_params": active_param_count(config.model),
                              **row, **pool}), flush=True)
        return 0
    m = config.model
    first = rows[0]
    active = (f" ({_si(active_param_count(m))}active: top {m.moe.experts_per_token} of {m.moe.num_experts} experts)"
              if m.moe.num_experts else "")
    print(f"model   {config.name}: {_si(param_count(m))}params{active}, {m.dtype}, {m.num_layers} layers, "
          f"{m.num_heads} q / {m.num_kv_heads} kv heads x {m.head_dim}; weights {_bytes(first['weight_bytes'])}")
    print(f"mesh    data={mesh.data} tensor={mesh.tensor} expert={mesh.expert} sequence={mesh.sequence} "
          f"stage={mesh.stage} "
          f"({mesh.size} devices); weights per device {_bytes(first['weight_bytes_per_device'])}, "
          f"KV per device {first['kv_bytes_per_token_per_device']} bytes/token"
          + (f", pages split over {mesh.sequence} sequence ranks" if mesh.sequence > 1 else ""))
    if mesh.stage > 1:
        print(f"stages  {mesh.stage} x {m.num_layers // mesh.stage} layers, up to {mesh.microbatches} microbatches: "
              f"{first['stage_boundary_bytes_per_token']} bytes/token cross each of {mesh.stage - 1} "
              f"boundaries vs {first['tensor_allreduce_bytes_per_token_per_device']:.0f} bytes/token/device "
              "of tensor all-reduces")
    print(f"device  {hw.name}: {hw.description}; {_si(hw.peak_flops(m.dtype), 'FLOP/s')} {m.dtype}, "
          f"{_bytes(hw.hbm_bytes)} at {_si(hw.hbm_bytes_per_s, 'B/s')}, link {_si(hw.link_bytes_per_s, 'B/s')}")
    print(f"        source: {hw.source}")
    kv_dtype = config.engine.kv_cache_dtype
    per_head = (f"{m.head_dim} x {m.jnp_dtype.dtype.itemsize} B" if kv_dtype == "auto"
                else f"({m.head_dim} x 1 B + 4 B f32 scale)")
    kv_formula = (f"{m.kv_layers} layers x one latent" if m.mla.enabled  # K and V share the latent row
                  else f"2 x {m.kv_layers} layers x {m.num_kv_heads} kv heads")
    print(f"KV      {first['kv_bytes_per_token']} bytes/token, {kv_dtype if kv_dtype != 'auto' else m.dtype} "
          f"({kv_formula} x {per_head}), "
          f"page_size {config.engine.page_size}")
    print(f"pool    engine.num_pages=0: {pool['kv_pool_pages']} pages = {pool['kv_pool_tokens']} tokens per "
          f"replica at memory_utilization {pool['memory_utilization']:g}, activations "
          f"{_bytes(pool['activation_bytes'])} (engine/memory.py)")
    print()
    if mesh.sequence > 1:
        for row in rows:
            row.setdefault("pass_kv_collective_bytes_per_device", None)  # not eligible: pass-Q only
    columns = (PLAN_COLUMNS + (CONTEXT_COLUMNS if mesh.sequence > 1 else []) + (STAGE_COLUMNS if mesh.stage > 1 else [])
               + (TRANSFER_COLUMNS if args.link_gbps is not None else []))
    print(format_table(rows, columns))
    print("\nTTFT floor = max(FLOPs/peak, bytes/bandwidth) per device + collectives; "
          "fit = requests of this length whose KV fits beside the weights (x data replicas).")
    print(f"KV/device = KV bytes per device, this prompt's K/V on one device (/ tensor, / sequence); fits = weights + KV/device + "
          f"an activation estimate <= {config.engine.memory_utilization:g} x HBM "
          f"({_bytes(first['hbm_bytes_per_device'])}).")
    if mesh.sequence > 1:
        cheaper = ", ".join(sorted({str(r.get("cheaper_ring_mode")) for r in rows}))
        print(f"sequence={mesh.sequence}: the KV pool is split over the sequence ranks; ring = the context-parallel "
              f"attention form of the floor, the one the engine runs (model.context_attention={m.attention.context_attention}; "
              f"the cheaper on this hardware: {cheaper}): pass-Q (all-gather Q + new K/V, "
              f"reduce-scatter + all-max of the f32 outputs) or pass-KV ({mesh.sequence - 1} hops of the new K/V, "
              f"fresh prompts only, dense blocks: 2x the causal attention FLOPs); bytes sent per device at "
              f"{_si(hw.link_bytes_per_s, 'B/s')}. The engine chunks prompts at engine.max_num_batched_tokens="
              f"{config.engine.max_num_batched_tokens}; the floor is one step.")
    if mesh.stage > 1:
        print("With stages: (microbatches + stages - 1) ticks of one stage's work on one microbatch, "
              "+ stage xfer = (stages - 1) hand-overs of one microbatch's activations; bubble = idle "
              "share per stage.")
    if args.link_gbps is not None:
        print(f"KV moved = the prompt's K/V, prefill pool to decode pool, once per request; "
              f"transfer = KV moved / {args.link_gbps:g} Gbit/s (bandwidth only, no latency).")
    return 0
