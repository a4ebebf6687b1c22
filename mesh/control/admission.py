"""Admission: the one place that decides whether a request may take lanes now.

Each pipeline has a lane budget from the plan (every stage holds that many lanes' KV
within its memory); a request takes one lane per choice for its life, all of them at once
(a request with n choices never holds some lanes while it waits for the rest: two such
requests would starve each other). Requests beyond the budget wait in a bounded, first-come
queue for a bounded time, then are told busy (the gateway's 503 with Retry-After). The
gateway's concurrent-request slots are the same mechanism with a budget of requests.
Works across event loops and threads: each waiter waits on a future of its own loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from skippy.topology.errors import OverCapacity

QUEUE_WAIT_S = 30.0   # how long a request waits for its lanes


@dataclass
class _Waiter:
    k: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future = field(default=None)


class LaneAdmission:
    def __init__(self, lanes: int, *, queue: int | None = None,
                 wait_s: float = QUEUE_WAIT_S):
        if lanes < 1:
            raise ValueError(f"a lane budget of at least 1, not {lanes}")
        self.lanes, self.wait_s = lanes, wait_s
        self.max_queue = 4 * lanes if queue is None else queue
        self.in_use = 0
        self.refused = 0
        self.paused = False  # every request waits (the engine's plan is changing)
        self._waiters: deque[_Waiter] = deque()
        self._lock = threading.Lock()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, k: int = 1) -> None:
        """Take k lanes at once, waiting in line for them a bounded time."""
        if not 1 <= k <= self.lanes:
            raise ValueError(f"{k} lanes asked of a budget of {self.lanes}")
        loop = asyncio.get_running_loop()
        with self._lock:
            if self.in_use + k <= self.lanes and not self._waiters and not self.paused:
                self.in_use += k
                return
            if len(self._waiters) >= self.max_queue:
                self.refused += 1
                raise OverCapacity(f"all {self.lanes} lanes are busy and {self.max_queue} "
                                   "requests wait", retry_after=self.wait_s / 10)
            waiter = _Waiter(k, loop, loop.create_future())
            self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), self.wait_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            self._give_up(waiter)
            if isinstance(e, asyncio.CancelledError):
                raise
            self.refused += 1
            raise OverCapacity(f"no lane came free in {self.wait_s:.0f} s",
                               retry_after=self.wait_s / 10) from None

    async def hold(self, k: int = 1) -> Callable[[], None]:
        """Take k lanes (`acquire`); returns what gives them back, once however often it
        is called (a request's end may be reached by several paths)."""
        await self.acquire(k)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.release(k)
        return release

    def _give_up(self, waiter: _Waiter) -> None:
        with self._lock:
            if waiter in self._waiters:  # never granted: leave the line
                self._waiters.remove(waiter)
                self._grant_waiting()     # those behind it may fit now
                return
        self.release(waiter.k)            # granted as it gave up: hand the lanes on

    def release(self, k: int = 1) -> None:
        with self._lock:
            self.in_use -= k
            self._grant_waiting()

    def _grant_waiting(self) -> None:
        """Under the lock: grant waiters in order while the first one fits."""
        while self._waiters and self.in_use + self._waiters[0].k <= self.lanes \
                and not self.paused:
            waiter = self._waiters.popleft()
            if waiter.loop.is_closed():
                continue
            self.in_use += waiter.k
            waiter.loop.call_soon_threadsafe(_grant, waiter.future)

    def resize(self, lanes: int) -> None:
        """A new budget (pipelines added or retired): waiters that now fit go on."""
        with self._lock:
            self.lanes = max(1, lanes)
            self._grant_waiting()

    def pause(self, paused: bool) -> None:
        """While paused no request takes lanes: they wait in line (their bounded time)."""
        with self._lock:
            self.paused = paused
            self._grant_waiting()

    def stats(self) -> dict:
        return {"lanes": self.lanes, "in_use": self.in_use, "waiting": self.waiting,
                "refused": self.refused}


def _grant(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
