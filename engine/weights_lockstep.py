"""update_weights, sleep and wake over several processes (jax.distributed): process 0
announces, every process acts on its own shards, at the same point of the lockstep stream
(engine/lockstep.py).

    process 0                                  processes 1 .. N-1 (Runner.follow)
    WEIGHTS_LOAD [path] ------------------>    load this process's shards of the checkpoint
    agree(ok) <------- all processes ------>   agree(ok): all loaded, or every one drops its
    ... steps that settle the requests in flight (RUN), on the old weights ...
    WEIGHTS_SWAP ------------------------->    swap in the loaded params, empty the host tier
    SLEEP [level, discard] / WAKE -------->    release / restore this process's arrays

Only a checkpoint path crosses processes (each reads only its own devices' slices, as at
build); a params tree or (name, array) pairs live in process 0 alone and are refused.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxfill.engine.lockstep import SLEEP, WAKE, WEIGHTS_DROP, WEIGHTS_LOAD, WEIGHTS_SWAP
from jaxfill.engine.sleep import SleepState, release, restore
from jaxfill.engine.weights_update import WeightUpdateError, clear_tier, flat_leaves, from_checkpoint, swap


@dataclasses.dataclass
class FollowerWeights:
    """A follower's side: params loaded and agreed on, waiting for WEIGHTS_SWAP; its sleep."""
    pending: dict | None = None
    sleep: SleepState = dataclasses.field(default_factory=SleepState)


def encode_path(path: str) -> np.ndarray:  # [ceil(bytes / 4)] int32, then the byte count
    raw = path.encode()
    padded = raw + b"\0" * (-len(raw) % 4)
    return np.concatenate([np.frombuffer(padded, np.int32), np.asarray([len(raw)], np.int32)])


def decode_path(words: np.ndarray) -> str:
    return np.asarray(words[:-1], np.int32).tobytes()[:int(words[-1])].decode()


def _load(runner, path: str) -> tuple[dict | None, Exception | None]:
    try:
        return from_checkpoint(runner.config, runner.mesh, path, flat_leaves(runner.state)), None
    except Exception as e:  # noqa: BLE001 - every process must reach agree() whatever happened
        return None, e


def _drop(new: dict | None) -> None:
    for a in (new or {}).values():
        if not a.is_deleted():
            a.delete()


def leader_load(runner, path: str) -> dict:
    """Process 0: every process loads its shards of `path`; all succeed or none keeps any."""
    runner.lockstep.send(WEIGHTS_LOAD, words=encode_path(path))
    new, error = _load(runner, path)
    if runner.lockstep.agree(error is None):
        return new
    _drop(new)
    if isinstance(error, WeightUpdateError):
        raise error
    raise WeightUpdateError(f"{path}: {error}" if error else f"{path}: another process could not load it "
                            "(see its log); nothing changed")


def leader_swap(runner) -> None:
    runner.lockstep.send(WEIGHTS_SWAP)


def leader_drop(runner) -> None:
    """Process 0 gave up after the load (an interrupt while settling): the others drop theirs."""
    runner.lockstep.send(WEIGHTS_DROP)


def follow(runner, op: int, words) -> None:
    """A follower's WEIGHT_OPS message."""
    import logging

    mine = runner.__dict__.setdefault("_follower_weights", FollowerWeights())
    if op == WEIGHTS_LOAD:
        new, error = _load(runner, decode_path(words))
        if error is not None:
            logging.getLogger("jaxfill.runner").error("update_weights: this process could not load: %s", error)
        if runner.lockstep.agree(error is None):
            mine.pending = new
        else:
            _drop(new)
    elif op == WEIGHTS_SWAP:
        swap(runner, mine.pending)
        mine.pending = None
        if runner.kv_offload is not None:
            clear_tier(runner.kv_offload)
    elif op == WEIGHTS_DROP:
        _drop(mine.pending)
        mine.pending = None
    elif op == SLEEP:
        level, discard = (int(x) for x in words[:2])
        if runner.kv_offload is not None:
            runner.kv_offload.sync()
        release(runner, mine.sleep, level, bool(discard))
    elif op == WAKE:
        restore(runner, mine.sleep)
