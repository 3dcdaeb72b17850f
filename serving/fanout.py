"""n > 1 over a protocol whose request carries one sample: the vLLM servicer fans the
request out into n one-sample requests and merges their messages as they come."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses


def samples_of(params):
    """n > 1: one n = 1 request per sample, sample i seeded seed + i (as Engine's own n)."""
    return [dataclasses.replace(params, n=1, seed=None if params.seed is None else (params.seed + i) % 2**63)
            for i in range(params.n)]


async def merged(gens):
    """The messages of several async generators as they come; one failing fails all."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(gen):
        try:
            async with contextlib.aclosing(gen):
                async for msg in gen:
                    await queue.put(msg)
            await queue.put(done)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            await queue.put(e)

    tasks = [asyncio.ensure_future(pump(g)) for g in gens]
    try:
        left = len(tasks)
        while left:
            msg = await queue.get()
            if msg is done:
                left -= 1
            elif isinstance(msg, BaseException):
                raise msg
            else:
                yield msg
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
