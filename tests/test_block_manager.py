"""Block manager: exact page ids, ref counts, eviction order, prefix hashes."""

from jaxfill.engine.block_manager import BlockManager, hash_page, prefix_hashes


def test_allocate_in_order_and_null_page_reserved():
    bm = BlockManager(num_pages=6, page_size=4)
    assert bm.num_free == 5
    assert bm.allocate(3) == [1, 2, 3]
    assert bm.ref_counts == [0, 1, 1, 1, 0, 0]
    assert bm.allocate(2) == [4, 5]
    assert bm.num_free == 0
    assert not bm.can_allocate(1)
    bm.check()


def test_free_reverse_order_tail_pages_go_first():
    bm = BlockManager(num_pages=8, page_size=4)
    a = bm.allocate(3)  # [1, 2, 3]
    b = bm.allocate(2)  # [4, 5]
    bm.free(a)
    # queue: 6, 7, then a's pages tail first: 3, 2, 1
    assert list(bm.free_queue) == [6, 7, 3, 2, 1]
    bm.free(b)
    assert list(bm.free_queue) == [6, 7, 3, 2, 1, 5, 4]
    assert bm.allocate(4) == [6, 7, 3, 2]
    bm.check()


def test_ref_counts_shared_pages():
    bm = BlockManager(num_pages=5, page_size=2)
    toks = [1, 2, 3, 4, 5]
    pages = bm.allocate(3)
    hs = prefix_hashes(toks, 2)
    assert len(hs) == 2
    for p, h in zip(pages, hs):
        bm.register(p, h)
    assert bm.lookup(prefix_hashes([1, 2, 3, 4, 9, 9], 2)) == [1, 2]
    bm.acquire([1, 2])
    assert bm.ref_counts[1:4] == [2, 2, 1]
    bm.free(pages)
    assert bm.ref_counts[1:4] == [1, 1, 0]
    assert list(bm.free_queue) == [4, 3]
    bm.free([1, 2])
    assert list(bm.free_queue) == [4, 3, 2, 1]
    bm.check()


def test_lru_eviction_of_cached_pages():
    bm = BlockManager(num_pages=5, page_size=2)
    # Request A: pages 1, 2 with prefix [1,2][3,4]; request B: pages 3, 4 with [5,6][7,8].
    a, b = bm.allocate(2), bm.allocate(2)
    ha, hb = prefix_hashes([1, 2, 3, 4], 2), prefix_hashes([5, 6, 7, 8], 2)
    for p, h in zip(a + b, ha + hb):
        bm.register(p, h)
    bm.free(a)
    bm.free(b)
    assert list(bm.free_queue) == [2, 1, 4, 3]
    # A cache hit on A's first page takes it out of the queue.
    assert bm.lookup(ha) == [1, 2]
    bm.acquire([1])
    assert list(bm.free_queue) == [2, 4, 3]
    # Allocation evicts from the head: page 2 (A's tail), then 4 (B's tail).
    assert bm.allocate(2) == [2, 4]
    assert bm.lookup(ha) == [1]  # A's second page is gone
    assert bm.lookup(hb) == [3]  # B's first page still cached
    assert bm.page_hash[2] is None and bm.page_hash[4] is None
    bm.check()


def test_hash_chain_and_salt():
    t = list(range(16))
    assert prefix_hashes(t, 4) == prefix_hashes(t + [99], 4)
    assert prefix_hashes(t, 4)[:2] == prefix_hashes(t[:8] + [7] * 8, 4)[:2]
    assert prefix_hashes(t, 4)[2] != prefix_hashes(t[:8] + [7] * 8, 4)[2]
    # Same page tokens under a different parent hash differently.
    assert hash_page(None, [1, 2]) != hash_page(hash_page(None, [0, 0]), [1, 2])
    assert prefix_hashes(t, 4, salt="a")[0] != prefix_hashes(t, 4)[0]
    assert prefix_hashes(t, 4, salt="a") == prefix_hashes(t, 4, salt="a")
    # Incremental hashing equals hashing all at once.
    head = prefix_hashes(t[:8], 4, salt="s")
    assert head + prefix_hashes(t, 4, salt="s", start=2, parent=head[-1]) == prefix_hashes(t, 4, salt="s")


def test_duplicate_prefix_keeps_first_copy_and_caching_off():
    bm = BlockManager(num_pages=4, page_size=2)
    h = prefix_hashes([1, 2], 2)
    p, q = bm.allocate(2)
    bm.register(p, h[0])
    bm.register(q, h[0])
    assert bm.cached == {h[0]: p} and bm.page_hash[q] is None
    off = BlockManager(num_pages=4, page_size=2, enable_prefix_caching=False)
    (r,) = off.allocate(1)
    off.register(r, h[0])
    assert off.lookup(h) == []


def test_can_allocate_counts_hits_taken_from_free_queue():
    bm = BlockManager(num_pages=4, page_size=2)
    (p,) = bm.allocate(1)
    h = prefix_hashes([1, 2], 2)
    bm.register(p, h[0])
    bm.free([p])
    assert bm.num_free == 3
    assert bm.can_allocate(2, hit_pages=[p])
    assert not bm.can_allocate(3, hit_pages=[p])
