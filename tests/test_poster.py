"""serving/poster.py: the engine thread's posts reach the event loop in order, none lost,
and the posting thread never wakes the loop itself (the GIL hand-off it cost per step)."""

import asyncio
import threading

from jaxfill.serving.poster import Poster


def _run_posts(n_items: int, raise_on: set[int] = frozenset()):
    """Posts 0..n-1 from a thread named `engine`; returns (delivered, threads that woke the loop)."""
    loop = asyncio.new_event_loop()
    delivered: list[int] = []
    wakers: list[str] = []
    real = loop.call_soon_threadsafe

    def spy(*a, **k):
        wakers.append(threading.current_thread().name)
        return real(*a, **k)

    loop.call_soon_threadsafe = spy
    errors: list = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx.get("exception")))

    def deliver(i, tag):
        assert tag == f"t{i}"
        if i in raise_on:
            raise ValueError(i)
        delivered.append(i)

    poster = Poster(loop, deliver)

    def engine():
        for i in range(n_items):
            poster.post(i, f"t{i}")
        poster.close()

    async def main():
        t = threading.Thread(target=engine, name="engine")
        t.start()
        deadline = loop.time() + 30  # a lost item fails the asserts below instead of hanging
        while (t.is_alive() or len(delivered) + len(errors) < n_items) and loop.time() < deadline:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)

    loop.run_until_complete(main())
    loop.close()
    return delivered, wakers, errors


def test_order_kept_nothing_lost():
    delivered, wakers, _ = _run_posts(2000)
    assert delivered == list(range(2000))
    assert wakers and "engine" not in wakers  # the post thread woke the loop, never the poster


def test_a_raising_delivery_loses_no_later_item():
    delivered, _, errors = _run_posts(50, raise_on={3, 17})
    assert delivered == [i for i in range(50) if i not in (3, 17)]
    assert sorted(e.args[0] for e in errors) == [3, 17]


def test_close_on_a_closed_loop_returns():
    loop = asyncio.new_event_loop()
    poster = Poster(loop, lambda *a: None)
    loop.close()
    poster.post(1)
    poster.close(timeout=5)
    assert not poster._thread.is_alive()
