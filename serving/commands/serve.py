"""`jaxfill serve`: the gRPC server (Generation + JetStream shim + VllmEngine + health + reflection)."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time

COMMAND = ("serve",)
HELP = ("serve the model over gRPC (jaxfill.v1.Generation, JetStream Orchestrator, vLLM's VllmEngine for the "
        "smg gateway, health, reflection)")


def add_arguments(p) -> None:
    from jaxfill.serving.cli import common_model_args

    common_model_args(p, multi_process=True)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0 = pick a free one)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name the vLLM protocol reports (default: the model directory's basename, "
                        "else the config name)")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port (off by default)")
    p.add_argument("--api-key", default=None, help="require `authorization: Bearer KEY` on every RPC but health")
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain (with --tls-key: serve TLS)")
    p.add_argument("--tls-key", default=None, help="PEM private key")
    p.add_argument("--max-message-mb", type=float, default=16.0, help="largest gRPC message either way")
    p.add_argument("--grace-period", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM/SIGINT")
    p.add_argument("--no-warmup", action="store_true", help="skip compiling the shape buckets up front")
    p.add_argument("--gil-switch-interval-ms", type=float, default=0.5,
                   help="sys.setswitchinterval: how long the engine thread may hold the GIL while the "
                        "gRPC event loop waits to stream tokens (Python's default is 5 ms)")
    p.add_argument("--role", choices=("prefill", "decode", "both"), default="both",
                   help="disaggregated serving behind `smg launch --pd-disaggregation`: a prefill worker keeps "
                        "each prompt's KV pages for a decode worker to pull (JAX transfer server); both = "
                        "an ordinary worker (default)")
    p.add_argument("--kv-host", default=None,
                   help="address this worker's KV transfer server binds and advertises, and decode workers "
                        "reach its gRPC port at for releases (default: --host, or 127.0.0.1 when --host is "
                        "a wildcard)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="load a PEFT LoRA adapter under NAME (repeatable; needs --set lora.max_loras=N); requests "
                        "name it (jaxfill.v1 lora, JetStream lora_adapter_id)")
    p.add_argument("--log-level", default="INFO")


def _log_startup(log, engine, args, load_s: float) -> None:
    cfg = engine.config
    m = cfg.model
    src = cfg.model_path or f"random init (seed {m.seed})"
    from jaxfill.serving.request_core import served_name

    log.info("loaded %s: %s, %d layers, hidden %d, heads %d/%d kv, vocab %d, dtype %s from %s in %.1f s; "
             "served as %r", cfg.name, m.architecture, m.num_layers, m.hidden_size, m.num_heads,
             m.num_kv_heads, m.vocab_size, m.dtype, src, load_s, args.served_model_name or served_name(cfg))
    e = cfg.engine
    log.info("engine: %d pages x %d tokens, max_model_len %d, max_num_seqs %d, token budget %d, max_waiting %d",
             e.num_pages, e.page_size, e.max_model_len, e.max_num_seqs, e.max_num_batched_tokens, e.max_waiting)
    if engine.runner.pool is not None:  # engine.num_pages = 0: how the pool was sized
        log.info("%s", engine.runner.pool.describe())
    import jax

    devs = jax.devices()
    log.info("mesh: data=%d tensor=%d expert=%d sequence=%d on %d %s device(s) in %d process(es)", cfg.mesh.data,
             cfg.mesh.tensor, cfg.mesh.expert, cfg.mesh.sequence, len(devs), devs[0].platform, jax.process_count())


def build_engine(config: str | None, model: str | None, overrides, role: str = "both",
                 compile_cache: str | None = "default"):
    """The Engine, not yet warmed up: the server listens (health NOT_SERVING) while it compiles.
    What the role cannot serve is refused before any weight is read. `compile_cache`: the
    directory the CLI set up, None when --compile-cache none turned it off."""
    from jaxfill.engine.config import load_config
    from jaxfill.engine.engine import Engine
    from jaxfill.engine.validation import role_flags, validate

    cfg = load_config(config, overrides, model)
    validate(cfg, extra=role_flags(role))
    return Engine(cfg, progress=False, warmup=False, compile_cache=compile_cache)


async def _serve(args, engine, log) -> int:
    from jaxfill.engine.batch import describe_buckets
    from jaxfill.serving.server import Server

    server = Server(engine, host=args.host, port=args.port, metrics_port=args.metrics_port, api_key=args.api_key,
                    tls_cert=args.tls_cert, tls_key=args.tls_key,
                    max_message_bytes=int(args.max_message_mb * (1 << 20)), warmup=not args.no_warmup,
                    served_model_name=args.served_model_name)
    from jaxfill.serving.disagg import Disagg

    kv_host = args.kv_host or (args.host if args.host not in ("0.0.0.0", "::", "") else "127.0.0.1")
    server.vllm.disagg = Disagg(engine, server.loop, args.role, kv_host)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    port = await server.start()
    server.vllm.disagg.grpc_address = f"{kv_host}:{port}"
    if args.role != "both":
        log.info("role %s: KV transfer server at %s", args.role, engine.kv_handoff.agent.address)
    scheme = "grpcs" if args.tls_cert else "grpc"
    log.info("listening on %s://%s:%d (health NOT_SERVING until warm-up ends)%s", scheme, args.host, port,
             "; auth: API key" if args.api_key else "")
    if server.metrics_port is not None:
        log.info("metrics on http://%s:%d/metrics", server.metrics_host, server.metrics_port)
    start = time.perf_counter()
    ready_logged = False
    while not stop.is_set():
        if server.loop.state == "failed":
            log.error("warm-up failed: %s", server.loop.error)
            await server.shutdown(0)
            return 1
        if not ready_logged and server.ready.is_set():
            ready_logged = True
            log.info("warm-up done in %.1f s (%s compiled); health SERVING", time.perf_counter() - start,
                     describe_buckets(engine.shapes))
        try:
            await asyncio.wait_for(stop.wait(), 0.2)
        except asyncio.TimeoutError:
            pass
    log.info("signal received: draining (health NOT_SERVING, new requests refused, %d in flight, grace %.0f s)",
             server.loop.num_active, args.grace_period)
    result = await server.shutdown(args.grace_period)
    log.info("stopped: %d in flight at the signal, %d aborted after the grace period",
             result["in_flight"], result["aborted"])
    return 0


def run(args) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("jaxfill.serve")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.gil_switch_interval_ms > 0:
        sys.setswitchinterval(args.gil_switch_interval_ms / 1000.0)
    log.info("XLA compilation cache: %s", args.compile_cache or "off")
    start = time.perf_counter()
    engine = build_engine(args.config, args.model, args.overrides, args.role, args.compile_cache)
    for item in args.lora:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora {item!r} must look like NAME=PATH")
        engine.load_lora(name, path)
    _log_startup(log, engine, args, time.perf_counter() - start)
    if not engine.is_leader:
        import jax

        log.info("process %d of %d: following process 0 (it owns the scheduler and the gRPC endpoint)",
                 jax.process_index(), jax.process_count())
        steps = engine.follow()
        log.info("process 0 closed: %d steps run; exiting", steps)
        return 0
    return asyncio.run(_serve(args, engine, log))
