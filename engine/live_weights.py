"""Engine.update_weights: what happens to the requests in flight, then the swap.

    in_flight="finish": the engine steps until no request is unfinished, on the old
                        weights (their outputs wait in the outbox for the next step()),
                        then swaps; requests added meanwhile finish on the old weights too
    in_flight="abort":  every unfinished request finishes now with finish_reason "abort"

Either way the swap happens under the engine's lock with no request unfinished, so no
request ever mixes K/V of two weight versions; then every K/V of the old weights is
dropped (engine/weights_update.py flush_kv). Call it from the thread that steps (a
serving loop runs it on its engine thread); another stepping thread is refused.
Multi-process: a checkpoint path, loaded by every process (engine/weights_lockstep.py).
"""

from __future__ import annotations

import os
import time

from flax import nnx

from jaxfill.engine import weights_lockstep
from jaxfill.engine.sleep import SleepState, refuse_if_asleep
from jaxfill.engine.weights_update import (WeightUpdateError, flat_leaves, flush_kv, from_checkpoint, from_pairs,
                                           from_tree, swap)

IN_FLIGHT = ("finish", "abort")


def _settle(engine, in_flight: str) -> None:
    """[stepping thread] No request unfinished, no step in flight; outputs kept for step()."""
    core = engine.core
    if in_flight == "abort":
        for rid in list(engine.requests):
            core.abort(rid)
    outputs = []
    try:
        while engine.requests:
            outputs += engine.step()
        outputs += engine.step()  # async scheduling: the last dispatched step's tokens taken
    finally:
        core.return_outputs(outputs)


def _new_leaves(engine, source) -> dict:
    from jaxfill.models.execution_plan import ExecutionPlan

    runner = engine.runner
    current = flat_leaves(runner.state)
    if isinstance(source, (str, os.PathLike)):
        return from_checkpoint(engine.config, runner.mesh, os.fspath(source), current)
    if isinstance(source, (dict, nnx.State, nnx.Module)):
        return from_tree(current, source)
    try:
        pairs = iter(source)
    except TypeError:
        raise WeightUpdateError(f"source: a params tree, a checkpoint directory or (name, array) pairs, "
                                f"got {type(source).__name__}") from None
    return from_pairs(engine.config, ExecutionPlan.of_config(engine.config), current, pairs)


def update_weights(engine, sleep_state: SleepState, source, in_flight: str = "finish") -> dict:
    if in_flight not in IN_FLIGHT:
        raise ValueError(f"in_flight: one of {IN_FLIGHT}, got {in_flight!r}")
    refuse_if_asleep(sleep_state, "update_weights")
    core, runner = engine.core, engine.runner
    core.require_leader("update_weights")
    multi = runner.lockstep is not None
    if multi and not isinstance(source, (str, os.PathLike)):
        raise WeightUpdateError("source: a multi-process engine takes a checkpoint path (every process reads its "
                                "own shards); a params tree or (name, array) pairs live in process 0 alone")
    start = time.perf_counter()
    with core.claim_stepping():
        # everything read and checked first: a refusal changes nothing
        new = weights_lockstep.leader_load(runner, os.fspath(source)) if multi else _new_leaves(engine, source)
        swapped = False
        try:
            while not swapped:  # new arrays not swapped in (an interrupt) are garbage, freed with them
                _settle(engine, in_flight)
                with core.locked():
                    if engine.requests:  # added by another thread while settling: settle them too
                        continue
                    if multi:
                        weights_lockstep.leader_swap(runner)
                    freed = swap(runner, new)
                    swapped = True
                    flush_kv(engine.scheduler, runner.kv_offload)
        finally:
            if multi and not swapped:
                weights_lockstep.leader_drop(runner)
    return {"params_replaced": len(new), "freed_bytes": freed, "seconds": time.perf_counter() - start}
