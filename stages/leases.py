"""Leases: the prefix-cache hit a plan reported for a lane, pinned until its restore.

A pin keeps the entry from being evicted, so a restore that follows its plan cannot fail
for lack of the entry, however many prompts are recorded in between. A lease ends when
the restore consumes it, the lane is planned again, prefilled or freed, or it grows
older than its time limit (a caller that planned and went away): the owner checks
expiry lazily on its later calls and releases the hits handed back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from skippy.cache.prefix_cache import Hit


@dataclass(frozen=True)
class Lease:
    hit: Hit                  # pinned in the prefix cache
    scope: bytes              # the stage digest it was looked up under
    tokens: tuple[int, ...]   # the prefix it serves: tokens[:hit.length]
    taken: float              # clock time of the plan

    def serves(self, scope: bytes, tokens: Sequence[int], start: int) -> bool:
        """Whether a restore of tokens[:start] under `scope` is what was planned."""
        return (self.scope == scope and self.hit.length == start
                and self.tokens == tuple(tokens[:start]))


class Leases:
    """At most one lease per lane. Not thread-safe: owned by one StageCache."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic):
        if seconds <= 0:
            raise ValueError("a lease must last > 0 seconds")
        self.seconds, self.clock = seconds, clock
        self._by_lane: dict[int, Lease] = {}
        self.expired = 0   # leases that ran out before their restore

    def __len__(self) -> int:
        return len(self._by_lane)

    def grant(self, lane: int, hit: Hit, scope: bytes, tokens: Sequence[int]) -> None:
        """Lease a pinned hit to `lane`; the lane must hold none (take() it first)."""
        if lane in self._by_lane:
            raise ValueError(f"lane {lane} already holds a lease")
        self._by_lane[lane] = Lease(hit, scope, tuple(tokens[:hit.length]), self.clock())

    def take(self, lane: int) -> Lease | None:
        """The lane's lease, now the caller's to consume or release."""
        return self._by_lane.pop(lane, None)

    def take_expired(self) -> list[Lease]:
        """Leases older than the limit, removed: the caller releases their hits."""
        deadline = self.clock() - self.seconds
        old = [lane for lane, lease in self._by_lane.items() if lease.taken < deadline]
        self.expired += len(old)
        return [self._by_lane.pop(lane) for lane in old]
