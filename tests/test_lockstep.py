"""The lockstep message (engine/lockstep.py): a batch survives pack -> int32 words ->
unpack bit for bit (floats, uint32 seeds, bools, stacked replicas), and the one buffer
fits the largest bucket."""

import jax
import numpy as np

from jaxfill.engine.batch import build_batch, stack_batches
from jaxfill.engine.lockstep import pack, unpack
from jaxfill.engine.request import Request, SamplingParams
from jaxfill.engine.scheduler import Scheduler
from test_scheduler import settings


def scheduled_batch(seed: int):
    """A real scheduled batch whose leaves are all non-trivial: floats, seeds, logprob flags."""
    rng = np.random.RandomState(seed)
    sched = Scheduler(settings(max_num_batched_tokens=64))
    for i in range(3):
        params = SamplingParams(temperature=float(rng.uniform(0.1, 2)), top_p=0.9, min_p=0.05,
                                repetition_penalty=1.3, logprobs=2 if i % 2 else None, seed=int(rng.randint(1 << 62)))
        sched.add(Request(f"r{i}", rng.randint(0, 300, 5 + 3 * i).tolist(), params, arrival_seq=i,
                          seed=params.seed))
    return build_batch(sched.schedule(), (64, 4), 4, 16, 300, 8)


def test_pack_unpack_round_trip_bit_for_bit():
    batch = scheduled_batch(seed=1)
    words = pack(batch)
    assert words.dtype == np.int32 and words.size == sum(x.size for x in jax.tree.leaves(batch))
    padded = np.concatenate([words, np.full(7, -99, np.int32)])  # the message is padded to the largest bucket
    out = unpack(padded, batch)
    for a, b in zip(jax.tree.leaves(batch), jax.tree.leaves(out)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()


def test_stacked_replica_batches_round_trip():
    batch = stack_batches([scheduled_batch(seed=2), scheduled_batch(seed=3)])
    out = unpack(pack(batch), batch)
    assert out.tokens.shape[0] == 2
    for a, b in zip(jax.tree.leaves(batch), jax.tree.leaves(out)):
        np.testing.assert_array_equal(a, b)
