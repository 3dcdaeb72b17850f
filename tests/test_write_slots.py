"""The batch builder's slot mapping, which write_kv scatters with unique_indices=True:
within one step no two real tokens share a slot, even with shared prefix pages, chunked
prefills and preemption (a duplicate would be undefined behaviour on accelerators)."""

import random

import numpy as np
import pytest

from jaxfill.engine.batch import build_batch
from jaxfill.engine.scheduler import Scheduler
from test_scheduler import fake_step, mk, settings


@pytest.mark.parametrize("caching", [True, False])
def test_real_slots_of_every_step_are_distinct(caching):
    random.seed(3)
    s = settings(num_pages=24, max_num_batched_tokens=32, enable_prefix_caching=caching)
    sched = Scheduler(s)
    shared = [random.randrange(300) for _ in range(12)]  # three full pages every prompt shares
    pending = [mk(0, max_tokens=random.randint(1, 6),
                  tokens=shared[:random.choice([0, 4, 8, 12])] + [random.randrange(300) for _ in range(random.randint(1, 20))])
               for _ in range(60)]
    steps = saw_shared_page = 0
    while pending or sched.has_work():
        for _ in range(random.randint(0, 3)):
            if pending:
                sched.add(pending.pop())
        out = sched.schedule()
        if not out.seqs:
            continue
        batch = build_batch(out, (32, 8), s.page_size, s.max_pages_per_seq, 300, 4)
        slots = batch.meta.slot_mapping
        real = slots[slots >= 0]
        assert real.size == sum(x.num_new for x in out.seqs)
        assert len(np.unique(real)) == real.size, f"step {steps}: duplicate slots {np.sort(real)}"
        pages = [p for x in out.seqs for p in x.req.pages]
        saw_shared_page |= len(pages) > len(set(pages))
        fake_step(sched, out)
        steps += 1
    assert steps > 20
    assert saw_shared_page == caching  # the test did exercise pages shared between requests
