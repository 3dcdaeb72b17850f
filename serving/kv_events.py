"""Prefix-cache events from the engine thread to gRPC subscribers, numbered in batches.

The block managers' listener (engine/block_manager.py) only records on the engine thread;
the recorded events ride the same `call_soon_threadsafe` as the step's outputs and are
published here, on the event loop, as batches
`(sequence, wall time, replica, events, first event id)`, one per replica per step, so a
slow subscriber never holds up a step. The last KV_HISTORY_BATCHES are kept for a
subscriber resuming from a sequence number; one that falls KV_SUBSCRIBER_MAX_BACKLOG
batches behind is dropped (it gets None).
"""

from __future__ import annotations

import asyncio
import collections
import time

KV_HISTORY_BATCHES = 1024  # KV event batches kept for subscribers resuming from a sequence number
KV_SUBSCRIBER_MAX_BACKLOG = 4096  # batches a subscriber may fall behind before it is dropped


class KVEventBus:
    def __init__(self):
        self.pending: list = []  # engine thread: (replica, event) since the last post
        self._subscribers: set[asyncio.Queue] = set()  # event-loop side
        self._history: collections.deque = collections.deque(maxlen=KV_HISTORY_BATCHES)
        self.sequence = 0  # the last batch's number (event-loop side)
        self._published = 0  # events are numbered from 1 across batches

    def record(self, replica: int, *event) -> None:
        """The block managers' listener: records only (engine thread, inside the step)."""
        self.pending.append((replica, event))

    def take(self) -> list:
        """Engine thread: the events recorded since the last take, to post with a step."""
        events, self.pending = self.pending, []
        return events

    def subscribe(self, start_sequence: int = 0) -> asyncio.Queue:
        """A queue of batches from now on (and, for start_sequence > 0, the kept batches
        numbered from it). A None item means the subscriber fell too far behind."""
        q: asyncio.Queue = asyncio.Queue()
        if start_sequence > 0:
            for batch in self._history:
                if batch[0] >= start_sequence:
                    q.put_nowait(batch)
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self._subscribers.discard(q)

    def publish(self, events: list) -> None:
        """Event loop: one numbered batch per replica to every subscriber."""
        by_replica: dict[int, list] = {}
        for replica, event in events:
            by_replica.setdefault(replica, []).append(event)
        for replica, evs in sorted(by_replica.items()):
            self.sequence += 1
            batch = (self.sequence, time.time(), replica, evs, self._published + 1)
            self._published += len(evs)
            self._history.append(batch)
            for q in list(self._subscribers):
                if q.qsize() >= KV_SUBSCRIBER_MAX_BACKLOG:
                    self._subscribers.discard(q)
                    q.put_nowait(None)
                else:
                    q.put_nowait(batch)
