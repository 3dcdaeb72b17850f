"""`jaxfill <command>`: discovers the command modules in serving/commands/.

Each command lives in its own file, so adding one never touches another's code.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from jaxfill.serving import commands


class _MeshOverride(argparse.Action):
    """--coordinator / --num-processes / --process-id: shorthands for --set mesh.KEY=VALUE."""

    def __call__(self, parser, namespace, values, option_string=None):
        items = list(getattr(namespace, "overrides", None) or [])
        items.append(f"mesh.{self.dest}={values}")
        setattr(namespace, "overrides", items)


def common_model_args(parser: argparse.ArgumentParser, multi_process: bool = False) -> None:
    """--config / --model / --set, shared by every command that builds a model; with
    multi_process, the jax.distributed flags of commands that can run as N processes."""
    parser.add_argument("--config", default=None,
                        help="TOML file or preset name (default: with --model, engine settings from the "
                             "checkpoint: its context, a KV pool sized from device memory; without, tiny)")
    parser.add_argument("--model", default=None, help="Hugging Face model directory, or a GGUF file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config field, e.g. --set mesh.tensor=4 (repeatable)")
    parser.add_argument("--compile-cache", default=None, metavar="DIR",
                        help="persistent XLA compilation cache, so a restart loads the step programs "
                             "instead of compiling them (default: $JAXFILL_COMPILE_CACHE or "
                             "~/.cache/jaxfill/xla; 'none' turns it off)")
    if not multi_process:
        return
    multi = parser.add_argument_group(
        "multi-process (jax.distributed; on TPU pods and SLURM the environment is detected instead)")
    multi.add_argument("--coordinator", dest="coordinator", action=_MeshOverride, metavar="HOST:PORT",
                       help="process 0's address, the same on every process")
    multi.add_argument("--num-processes", dest="num_processes", action=_MeshOverride, metavar="N")
    multi.add_argument("--process-id", dest="process_id", action=_MeshOverride, metavar="I",
                       help="0 serves and schedules; 1..N-1 follow its steps")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxfill", description="JAX/XLA LLM inference built around prefill")
    top = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    mods = sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name)
    for info in mods:
        mod = importlib.import_module(f"jaxfill.serving.commands.{info.name}")
        path = mod.COMMAND
        if len(path) == 1:
            sub = top.add_parser(path[0], help=mod.HELP, description=mod.HELP)
        else:
            if path[0] not in groups:
                group = top.add_parser(path[0], help=f"{path[0]} commands")
                groups[path[0]] = group.add_subparsers(dest="subcommand", required=True)
            sub = groups[path[0]].add_parser(path[1], help=mod.HELP, description=mod.HELP)
        mod.add_arguments(sub)
        sub.set_defaults(run=mod.run)
    return parser


def _use_cpu_cores(args) -> None:
    """One XLA CPU device per core (engine/cpu_devices.py) before the command touches jax,
    unless the [mesh] (config file and --set) says otherwise, and the XLA:CPU flags for the
    model.dtype asked for; an unreadable config is left for the command to report."""
    from jaxfill.engine.config import MeshSettings, parse_overrides, read_preset
    from jaxfill.engine.cpu_devices import use_cpu_cores

    try:
        preset = read_preset(args.config or "tiny")[1] if args.config or not args.model else {}  # checkpoint: no [mesh]
        overrides = parse_overrides(args.overrides)
        settings = MeshSettings(**{**preset.get("mesh", {}), **overrides.get("mesh", {})})
        dtype = str({**preset.get("model", {}), **overrides.get("model", {})}.get("dtype", "float32"))
    except (ValueError, TypeError):
        return
    use_cpu_cores(settings, dtype)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(args, "compile_cache"):  # every command that builds a model
        _use_cpu_cores(args)
        from jaxfill.engine.compile_cache import enable_compile_cache

        args.compile_cache = enable_compile_cache(args.compile_cache)
    try:
        return int(args.run(args) or 0)
    except ValueError as e:  # ConfigError, InvalidRequest, CheckpointError are ValueErrors
        # Bad input: one clear line, not a traceback from deep inside JAX.
        print(f"jaxfill: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
