"""Step executables kept on disk under a key computed without tracing, so a warm start
neither traces nor lowers a step program.

jax's persistent cache keys a program by its lowered HLO: every start traces the model
and lowers it before it can look the executable up. For SmolLM2-135M's 30 unrolled
layers that was ~5.5 s a bucket of a 57 s warm `jaxfill generate` (cProfile, 2026-12-07;
benchmarks/RESULTS.md "`jaxfill generate` ... start time"). Here the key is what decides
the program (engine/activation_cache.py `program_key`: the jaxfill source, the resolved
config, the abstract arguments with their shardings, jax / jaxlib, the device kind, the
JAX_* / XLA_* environment) plus the step function, the attention impl that serves and the
static flag, and the value is jax's own serialized executable
(`jax.experimental.serialize_executable`). A stale entry cannot be hit: any edit to the
source, the config, the versions or the shapes changes the key.

Only a program compiled here is kept: one that jax's own cache already held is used as it
is and not kept (XLA:CPU loses its code when it is serialized again), so after an edit that
leaves a program's HLO alone a start costs what it did before, and a program is kept from
the first start that compiles it.

On only where jax's persistent cache is on (its directory holds the files) and for one
process: a multi-host run keeps jax's cache, whose keys every process computes alike.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import tempfile

import jax

from jaxfill.engine import activation_cache
from jaxfill.engine.compile_cache import count_cache_hits

log = logging.getLogger("jaxfill.executable_cache")
SUBDIR = "jaxfill_executables"


def enabled() -> bool:
    """Where jax's persistent cache is on (a directory, not switched off) in a one-process run."""
    return (bool(jax.config.jax_compilation_cache_dir) and bool(jax.config.jax_enable_compilation_cache)
            and jax.process_count() == 1)


def _signature(tree) -> tuple:
    """The batch's structure and leaf shapes: cheap enough for every step."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((getattr(x, "shape", None), getattr(x, "dtype", None)) for x in leaves)


class StepPrograms:
    """The runner's step programs by batch shape, each loaded from disk or compiled once.
    `hits` / `misses` count programs loaded from this cache / compiled (warm-up reports them)."""

    def __init__(self, step_fn, config, attention_impl: str):
        self.step_fn = step_fn  # the module-level jit (engine/step.py)
        self.config = config
        self.attention_impl = attention_impl
        self.programs: dict = {}  # (batch signature, scores_prompt) -> jax.stages.Compiled
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self.programs)

    def __call__(self, static_graph, state, kv_cache, batch, prev_tokens, scores_prompt: bool):
        sig = (_signature(batch), scores_prompt)
        program = self.programs.get(sig)
        if program is None:
            program = self.programs[sig] = self._load_or_compile(static_graph, state, kv_cache, batch,
                                                                 prev_tokens, scores_prompt)
        return program(state, kv_cache, batch, prev_tokens)

    def _key(self, *args) -> str:
        extra = f"{self.step_fn.__name__} {self.attention_impl} {len(jax.devices())}"
        return hashlib.sha256((activation_cache.program_key(self.config, *args) + extra).encode()).hexdigest()

    def _load_or_compile(self, static_graph, state, kv_cache, batch, prev_tokens, scores_prompt):
        from jax.experimental.serialize_executable import deserialize_and_load, serialize

        path = os.path.join(jax.config.jax_compilation_cache_dir, SUBDIR,
                            self._key(state, kv_cache, batch, prev_tokens, scores_prompt) + ".pkl")
        try:
            with open(path, "rb") as f:
                device_ids, serialized, in_tree, out_tree = pickle.load(f)
            # the devices it was compiled for, in order: by default jax would spread a
            # one-device program over every device of the process (the CPU split's two)
            by_id = {d.id: d for d in jax.devices()}
            program = deserialize_and_load(serialized, in_tree, out_tree,
                                           execution_devices=[by_id[i] for i in device_ids])
            self.hits += 1
            return program
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001 - a damaged or foreign entry costs one compile, nothing more
            log.warning("compiling again: cached executable %s did not load (%s)", path, e)
        with count_cache_hits() as jax_cache:
            program = self.step_fn.lower(static_graph, state, kv_cache, batch, prev_tokens, scores_prompt).compile()
        self.misses += 1
        if jax_cache["hits"]:
            # XLA:CPU drops the code of an executable jax loaded from its own cache when it is
            # serialized again ("Function reverse_add_fusion.2 not found" at the next load,
            # jaxlib 0.10.2), so only a program compiled here is kept. A source edit that
            # leaves the program alone still finds it in jax's cache, as before.
            return program
        try:
            device_ids = [d.id for d in program._executable._unloaded_executable.device_list]  # what serialize() reads too
            blob = pickle.dumps((device_ids, *serialize(program)))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".exe-")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)  # whole or not at all: a concurrent start never reads half a file
        except Exception as e:  # noqa: BLE001 - a read-only directory or an unserializable program
            log.warning("step executable not kept on disk (%s): the next start compiles it again", e)
        return program
