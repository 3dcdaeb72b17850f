"""Sleep and wake: the device memory of an idle engine given back, its compiled programs kept.

    level 1: the KV pool's arrays deleted, the device prefix cache emptied
    level 2: the params too: copied to host numpy first, or (discard) reloaded from the
             checkpoint at wake (engine.config.model_path)
    wake():  a fresh KV pool (and the params) placed exactly as before, so every jitted
             step still matches its compiled program: nothing compiles again

Sleep refuses while requests are unfinished (finish or abort them first), so no request's
K/V is ever lost under it; the host/disk KV tiers keep their blocks (the weights are the
same after wake). Multi-process: process 0 tells the others (SLEEP, WAKE; engine/
weights_lockstep.py) and each releases and restores its own shards. While asleep add_request raises EngineAsleep, and update_weights is
refused (wake first).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from jaxfill.engine.weights_update import flat_leaves, leaf_path, place_like
from jaxfill.models.lora import is_table_path


class EngineAsleep(RuntimeError):
    """The engine sleeps (Engine.sleep): nothing runs until Engine.wake()."""


@dataclasses.dataclass
class SleepState:
    level: int = 0  # 0 awake, 1 KV released, 2 KV and weights released
    discard: bool = False  # level 2: the weights are reloaded from the checkpoint at wake
    host: dict | None = None  # level 2, kept: param path -> (global shape, {box: numpy shard})


def _box(index: tuple, shape: tuple) -> tuple:
    """A shard's index (slices) as ((start, stop), ...), the key its host copy is kept under."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _to_host(a: jax.Array) -> tuple:
    """This process's shards of `a` as numpy, by box (a replicated box once)."""
    shards = {}
    for s in a.addressable_shards:
        key = _box(s.index, a.shape)
        if key not in shards:
            shards[key] = np.array(s.data, copy=True)  # never a view of the buffer deleted next (XLA:CPU)
    return a.shape, shards


def _placed_bytes(a) -> int:
    """Bytes of `a` on this process's devices, from its sharding alone: never its buffers,
    which a step on another thread may be donating."""
    return _sharded_bytes(a.shape, a.dtype, a.sharding)


@functools.lru_cache(maxsize=4096)
def _sharded_bytes(shape: tuple, dtype, sharding) -> int:
    """Cached: Engine.stats() asks after every serving step (~0.5 ms uncached on tiny)."""
    shard = int(np.prod(sharding.shard_shape(shape), dtype=np.int64)) * np.dtype(dtype).itemsize
    return shard * len(sharding.addressable_devices)


def engine_device_bytes(runner, level: int = 0) -> int:
    """Bytes of the engine's params, KV pool and step state on this process's devices, as
    they are at sleep `level` (what sleep released is not counted). Safe from any thread."""
    arrays = [runner.prev_tokens]
    if level < 2:
        arrays += jax.tree.leaves(runner.state)
    if level < 1:
        arrays += list(runner.kv_cache.arrays())
    return sum(_placed_bytes(a) for a in arrays)


def refuse_if_asleep(state: SleepState, what: str) -> None:
    if state.level:
        raise EngineAsleep(f"{what}: the engine sleeps (level {state.level}); call wake() first")


def check_level(level: int, discard: bool, model_path) -> None:
    if level not in (1, 2):
        raise ValueError(f"level: 1 (KV pool) or 2 (KV pool and weights), got {level!r}")
    if discard and level != 2:
        raise ValueError("discard: only level 2 releases the weights")
    if discard and not model_path:
        raise ValueError("discard: the weights are reloaded from the checkpoint at wake, and this engine has "
                         "none (random init): sleep(level=2) without discard keeps them on the host")


def sleep(engine, state: SleepState, level: int, discard: bool) -> dict:
    """Releases the KV pool (level 1) and the params (level 2). Returns the bytes freed."""
    check_level(level, discard, engine.config.model_path)
    refuse_if_asleep(state, "sleep")
    core, runner = engine.core, engine.runner
    core.require_leader("sleep")
    with core.claim_stepping():
        if engine.requests:
            raise RuntimeError(f"sleep: {len(engine.requests)} requests unfinished; let them finish or "
                               "abort them first (engine.abort_all())")
        core.return_outputs(engine.step())  # a dispatched step's tokens taken (async scheduling)
        with core.locked():
            before = engine_device_bytes(runner)
            runner.save_evicted()  # queued host-tier saves read their pages now, before the pool goes
            if runner.kv_offload is not None:
                runner.kv_offload.sync() if runner.lockstep is not None else runner.kv_offload.flush()
            engine.scheduler.recompute_all()  # no request runs: the prefix cache emptied
            if runner.lockstep is not None:
                from jaxfill.engine.lockstep import SLEEP

                runner.lockstep.send(SLEEP, words=np.asarray([level, int(discard)], np.int32))
            release(runner, state, level, discard)
            return {"level": level, "freed_bytes": before - engine_device_bytes(runner, level)}


def release(runner, state: SleepState, level: int, discard: bool) -> None:
    """[every process] The KV pool's arrays deleted, and at level 2 the params' (copied to
    the host first unless discard)."""
    jax.block_until_ready(runner.kv_cache)
    for a in runner.kv_cache.arrays():
        a.delete()
    if level == 2:
        leaves = jax.tree_util.tree_flatten_with_path(runner.state)[0]
        # with discard the checkpoint gives the weights back; the LoRA tables are kept (not in it)
        state.host = {leaf_path(kp): _to_host(a) for kp, a in leaves
                      if not discard or is_table_path(leaf_path(kp))}
        for _, a in leaves:
            a.delete()
    state.level, state.discard = level, discard


def wake(engine, state: SleepState) -> dict:
    """Restores what sleep released, placed as before. Returns the bytes placed."""
    runner = engine.runner
    if not state.level:
        return {"level": 0, "placed_bytes": 0}
    with engine.core.claim_stepping(), engine.core.locked():
        before = engine_device_bytes(runner, state.level)
        if runner.lockstep is not None:
            from jaxfill.engine.lockstep import WAKE

            runner.lockstep.send(WAKE)
        restore(runner, state)
        return {"level": 0, "placed_bytes": engine_device_bytes(runner) - before}


def restore(runner, state: SleepState) -> None:
    """[every process] The params (level 2) and a fresh KV pool, placed as before."""
    if state.level == 2:
        _restore_params(runner, state)
    runner.kv_cache = runner.fresh_cache()
    state.level, state.discard, state.host = 0, False, None


def _restore_params(runner, state: SleepState) -> None:
    pairs, treedef = jax.tree_util.tree_flatten_with_path(runner.state)
    current = {leaf_path(kp): a for kp, a in pairs}
    new = {}
    if state.discard:
        from jaxfill.engine.loading import build_model

        new = flat_leaves(build_model(runner.config, runner.mesh, progress=False))
        new = {p: a if a.sharding == current[p].sharding else jax.device_put(a, current[p].sharding)
               for p, a in new.items()}
    for p, (shape, shards) in state.host.items():  # with discard: the LoRA tables alone
        new[p] = place_like(current[p], lambda index, s=shards, n=shape: s[_box(index, n)], shape)
    runner.state = jax.tree_util.tree_unflatten(treedef, [new[leaf_path(kp)] for kp, _ in pairs])
