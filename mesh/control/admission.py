"""Admission: the one place that decides whether a request may take lanes now.

Each pipeline has a lane budget from the plan (every stage holds that many lanes' KV
within its memory); a request takes one lane per pipeline stage for its life. Requests
beyond the budget wait in a bounded queue for a bounded time, then are told busy (the
gateway's 503 with Retry-After). Works across event loops and threads: the gateway's loop
and the tests' each wait on their own futures.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque

from .engine import EngineBusy

QUEUE_WAIT_S = 30.0   # how long a request waits for a lane


class Admission:
    def __init__(self, lanes: int, *, queue: int | None = None,
                 wait_s: float = QUEUE_WAIT_S):
        if lanes < 1:
            raise ValueError(f"a lane budget of at least 1, not {lanes}")
        self.lanes, self.wait_s = lanes, wait_s
        self.max_queue = 4 * lanes if queue is None else queue
        self.in_use = 0
        self.refused = 0
        self._waiters: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = deque()
        self._lock = threading.Lock()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self.in_use < self.lanes and not self._waiters:
                self.in_use += 1
                return
            if len(self._waiters) >= self.max_queue:
                self.refused += 1
                raise EngineBusy(f"all {self.lanes} lanes are busy and {self.max_queue} "
                                 "requests wait", retry_after=self.wait_s / 10)
            future = loop.create_future()
            self._waiters.append((loop, future))
        try:
            await asyncio.wait_for(asyncio.shield(future), self.wait_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            with self._lock:
                if (loop, future) in self._waiters:  # never granted: leave the queue
                    self._waiters.remove((loop, future))
                    granted = False
                else:
                    granted = True
            if granted:  # granted as we gave up: hand the lane on
                self.release()
            if isinstance(e, asyncio.CancelledError):
                raise
            self.refused += 1
            raise EngineBusy(f"no lane came free in {self.wait_s:.0f} s",
                             retry_after=self.wait_s / 10) from None

    def release(self) -> None:
        with self._lock:
            while self._waiters:
                loop, future = self._waiters.popleft()
                if not loop.is_closed():
                    loop.call_soon_threadsafe(_grant, future)
                    return  # the lane passes to the waiter: in_use unchanged
            self.in_use -= 1

    def stats(self) -> dict:
        return {"lanes": self.lanes, "in_use": self.in_use, "waiting": self.waiting,
                "refused": self.refused}


def _grant(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
