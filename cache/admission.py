"""Admission: whether a prefix is worth capturing (a snapshot or an exported payload).

Capturing costs copies and evicts entries that may still be useful, so a prefix earns it by
being seen `admit_after` times; a stream of one-off prompts then captures nothing and
churns nothing. A lane continuing from its own last state needs no admission — it copies
nothing — and that decision belongs to the caller, not here.

Every cache object guards its state with one lock of its own and never calls another
cache object while holding it, so locks never nest.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class AdmissionStats:
    observed: int            # observe() calls
    admitted: int            # observe() calls that returned True
    rejected_unseen: int     # observe() calls that returned False (not seen often enough yet)
    bypassed_too_large: int  # admits_size() calls that returned False
    tracked: int             # keys in the sightings table now


class PrefixAdmission:
    """Counts sightings of prefix identity digests and admits a prefix on its
    `admit_after`-th sighting (and on every later one). The sightings table holds at most
    `max_tracked` keys; beyond that the least recently seen key is forgotten first, so a
    flood of unique prompts cannot grow it without bound."""

    def __init__(self, admit_after: int = 2, max_tracked: int = 8192):
        if admit_after < 1:
            raise ValueError(f"admit_after must be at least 1, got {admit_after}")
        if max_tracked < 1:
            raise ValueError(f"max_tracked must be at least 1, got {max_tracked}")
        self.admit_after = admit_after
        self.max_tracked = max_tracked
        self._lock = threading.Lock()
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # key -> sightings, LRU order
        self._observed = self._admitted = self._rejected = self._bypassed = 0

    def observe(self, key: bytes) -> bool:
        """Count one sighting of `key`; True once it has been seen `admit_after` times."""
        with self._lock:
            self._observed += 1
            # Saturate: the count only has to reach admit_after.
            count = min(self._seen.pop(key, 0) + 1, self.admit_after)
            self._seen[key] = count
            if len(self._seen) > self.max_tracked:
                self._seen.popitem(last=False)
            if count >= self.admit_after:
                self._admitted += 1
                return True
            self._rejected += 1
            return False

    def admits_size(self, nbytes: int, budget: int) -> bool:
        """Whether an entry of `nbytes` may enter a cache of `budget` bytes. An entry larger
        than the whole budget (or any entry, when the budget is 0 = disabled) bypasses the
        cache instead of evicting everything else to make room."""
        if nbytes < 0 or budget < 0:
            raise ValueError(f"sizes must be non-negative, got nbytes={nbytes} budget={budget}")
        fits = 0 < budget and nbytes <= budget
        if not fits:
            with self._lock:
                self._bypassed += 1
        return fits

    def forget(self, key: bytes) -> None:
        """Drop the sightings of `key` (e.g. its entry was evicted: it must earn admission
        again). Unknown keys are ignored."""
        with self._lock:
            self._seen.pop(key, None)

    def stats(self) -> AdmissionStats:
        with self._lock:
            return AdmissionStats(self._observed, self._admitted, self._rejected,
                                  self._bypassed, len(self._seen))
