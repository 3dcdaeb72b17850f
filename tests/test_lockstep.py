"""The lockstep message (engine/lockstep.py): a batch survives pack -> int32 words ->
unpack bit for bit (floats, uint32 seeds, bools, stacked replicas, rows whose tails
repeat a real value), a malformed message is refused, and a decode step's message is
sized by its content, not by the largest bucket."""

import jax
import numpy as np
import pytest

from jaxfill.engine.batch import bucket_shapes, build_batch, dummy_batch, stack_batches
from jaxfill.engine.config import load_config
from jaxfill.engine.lockstep import FIRST_WORDS, max_payload_words, message_words, pack, unpack
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
    assert words.dtype == np.int32 and words.size < sum(x.size for x in jax.tree.leaves(batch))
    out = unpack(words, batch)
    for a, b in zip(jax.tree.leaves(batch), jax.tree.leaves(out)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()


def test_stacked_replica_batches_round_trip():
    batch = stack_batches([scheduled_batch(seed=2), scheduled_batch(seed=3)])
    out = unpack(pack(batch), batch)
    assert out.tokens.shape[0] == 2
    for a, b in zip(jax.tree.leaves(batch), jax.tree.leaves(out)):
        np.testing.assert_array_equal(a, b)


def test_random_rows_with_repeated_tails_round_trip():
    """Trailing runs are cut to one word: rows ending in runs of real values (a page id
    repeated, NaN, -0.0) must come back exactly, not as padding."""
    rng = np.random.default_rng(4)
    batch = scheduled_batch(seed=5)
    leaves, treedef = jax.tree.flatten(batch)
    for trial in range(20):
        new = []
        for x in leaves:
            y = rng.integers(-3, 3, x.shape).astype(x.dtype) if x.dtype != np.float32 else \
                rng.choice(np.array([np.nan, -0.0, 0.0, 1.5], np.float32), x.shape)
            if y.ndim and y.shape[-1] > 1:  # a random-length tail of one repeated value per row
                tail = rng.integers(0, y.shape[-1], y.shape[:-1])
                mask = np.arange(y.shape[-1]) >= tail[..., None]
                y = np.where(mask, y[..., -1:], y)
            new.append(y)
        b = jax.tree.unflatten(treedef, new)
        out = unpack(pack(b), b)
        for a, c in zip(jax.tree.leaves(b), jax.tree.leaves(out)):
            assert a.tobytes() == c.tobytes(), trial


def test_malformed_message_is_refused():
    batch = scheduled_batch(seed=6)
    words = pack(batch)
    with pytest.raises(ValueError, match="shorter"):
        unpack(words[:-5], batch)
    with pytest.raises(ValueError, match="past the template"):
        unpack(np.concatenate([words, [0]]).astype(np.int32), batch)
    bad = words.copy()
    bad[0] = 0  # tokens row kept length 0
    with pytest.raises(ValueError, match="template"):
        unpack(bad, batch)


def test_decode_message_sized_by_content_not_largest_bucket():
    """llama3_1_8b's settings (no model built): page_indices [64, 8192] alone is 2 MiB.
    A 64-sequence decode at 1.5k context must be one FIRST_WORDS broadcast."""
    config = load_config("llama3_1_8b", {"engine.num_pages": 8192})  # the preset's 0 sizes from memory
    s, vocab = config.engine, config.model.vocab_size
    templates = [dummy_batch(shape, s.max_pages_per_seq, s.penalty_window, vocab) for shape in bucket_shapes(s)]
    b = dummy_batch((64, 64), s.max_pages_per_seq, s.penalty_window, vocab)
    ctx = 1500
    npg = -(-ctx // s.page_size)
    rng = np.random.default_rng(7)
    b.meta.page_indices[:, :npg] = rng.integers(1, s.num_pages, (64, npg))
    b.meta.kv_lens[:] = ctx
    b.meta.cu_q_lens[:] = np.arange(65)
    b.meta.num_seqs[0] = 64
    b.meta.slot_mapping[:] = rng.integers(0, s.num_pages * s.page_size, 64)
    b.tokens[:] = rng.integers(0, 128000, 64)
    b.positions[:] = ctx - 1
    b.sampling.temperature[:] = 0.7
    assert unpack(pack(b), b).meta.page_indices.tobytes() == b.meta.page_indices.tobytes()
    largest = max(max_payload_words(t) for t in templates)
    assert largest > 500_000
    assert message_words(b, templates) == FIRST_WORDS
    assert message_words(templates[-1], templates) == FIRST_WORDS  # warm-up's all-padding batch


@pytest.mark.parametrize("num_pages_used", [3, 200])  # one broadcast; a second one too
def test_send_then_receive_through_recorded_broadcasts(num_pages_used):
    """Leader's send() and a follower's receive() over the same broadcasts (recorded,
    single process): the follower sees each buffer with the shape it expects and gets
    the batch back exactly."""
    from jaxfill.engine.lockstep import RUN, Lockstep

    templates = [dummy_batch(shape, 256, 8, 320) for shape in [(16, 16), (64, 64)]]
    batch = dummy_batch((64, 64), 256, 8, 320)
    batch.meta.page_indices[:, :num_pages_used] = np.random.default_rng(8).integers(1, 999, (64, num_pages_used))
    sent = []

    def receive_one(buf):
        got = sent.pop(0)
        assert got.shape == buf.shape
        return got

    leader = Lockstep(templates, broadcast=lambda buf: sent.append(buf.copy()) or buf)
    follower = Lockstep(templates, broadcast=receive_one)
    leader.send(RUN, batch)
    assert len(sent) == (1 if num_pages_used < 100 else 2) and leader.words_sent == sum(b.size for b in sent)
    follower.is_leader = False
    op, out = follower.receive()
    assert op == RUN and not sent
    for a, b in zip(jax.tree.leaves(batch), jax.tree.leaves(out)):
        assert a.tobytes() == b.tobytes()
