"""How many request bytes each caller may have parsed a second, before any is read.

A request's body costs the gateway a JSON parse on its event loop (a 4 MiB body about
40 ms of one core, which no thread hides: the parser holds the interpreter). One key
repeating large requests would otherwise take the loop from everyone's streams. Each
caller (its key's tenant, or its address on a server without keys) has a bucket of
`rate` bytes a second, holding at most `burst`; a body larger than what is left is
refused with a 429 and Retry-After before it is read.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict

from .openai_api import ApiError

MAX_CALLERS = 10_000  # buckets kept; the least recently used goes first (a full bucket)


class BodyBudget:
    def __init__(self, rate: float, burst: float, clock=time.monotonic):
        self.rate, self.burst, self._clock = rate, burst, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # (bytes, at)

    def take(self, caller: str, nbytes: int) -> None:
        """Spend `nbytes` of `caller`'s budget, or raise the 429 that says when it has
        them (nothing spent)."""
        now = self._clock()
        left, at = self._buckets.pop(caller, (self.burst, now))
        left = min(self.burst, left + (now - at) * self.rate)
        if nbytes > left:
            self._keep(caller, left, now)
            wait = math.ceil((min(nbytes, self.burst) - left) / self.rate)
            raise ApiError(429, f"this key sent more than {self.rate / 2**20:g} MiB of "
                                f"requests a second: retry after {wait} s",
                           code="rate_limit_exceeded", type="rate_limit_error",
                           headers={"Retry-After": str(wait)})
        self._keep(caller, left - nbytes, now)

    def _keep(self, caller: str, left: float, now: float) -> None:
        self._buckets[caller] = (left, now)
        while len(self._buckets) > MAX_CALLERS:
            self._buckets.popitem(last=False)
