"""A keyed LRU of immutable values under entry and byte caps, with its own lock.

The base of the activation-frame cache and the exact-result cache: values are handed
out by reference and never mutated, so a reader needs no pin; eviction only forgets.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

from .resident import Refused, ResidentLru
from .telemetry import CacheStats, Counters, snapshot


class KeyedCache:
    kind = "keyed"

    def __init__(self, max_entries: int, max_bytes: int):
        self._lru = ResidentLru(max_entries, max_bytes)
        self._by_key: dict[Hashable, tuple[int, object]] = {}
        self._key_of: dict[int, Hashable] = {}
        self._counters = Counters()
        self._lock = threading.Lock()

    def get(self, key: Hashable, *, probe: bool = False):
        """The value, or None. A probe (warm-up, health) neither counts nor refreshes."""
        with self._lock:
            if probe:
                self._counters.probes += 1
                return None
            self._counters.lookups += 1
            found = self._by_key.get(key)
            if found is None:
                self._counters.misses += 1
                return None
            self._lru.touch(found[0])
            self._counters.hits += 1
            return found[1]

    def put(self, key: Hashable, value, nbytes: int) -> bool:
        """Store a value; False when it cannot fit (bypassed). A key already present is
        refreshed, not replaced: equal keys mean equal values here."""
        with self._lock:
            found = self._by_key.get(key)
            if found is not None:
                self._lru.touch(found[0])
                self._counters.refreshes += 1
                return True
            try:
                entry_id, evicted = self._lru.allocate(nbytes)
            except Refused:
                self._counters.bypasses += 1
                return False
            for eid in evicted:
                del self._by_key[self._key_of.pop(eid)]
            self._counters.evictions += len(evicted)
            self._lru.commit(entry_id)
            self._by_key[key] = (entry_id, value)
            self._key_of[entry_id] = key
            self._counters.records += 1
            return True

    def remove(self, key: Hashable) -> None:
        with self._lock:
            found = self._by_key.pop(key, None)
            if found is not None:
                self._lru.remove(found[0])
                del self._key_of[found[0]]

    def clear(self) -> None:
        with self._lock:
            self._lru.clear()
            self._by_key.clear()
            self._key_of.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_key)

    def stats(self) -> CacheStats:
        with self._lock:
            u = self._lru.usage()
            return CacheStats(self.kind, u.entries, u.resident_bytes, u.reserved_bytes,
                              u.evictable_bytes, u.pinned_entries, snapshot(self._counters))
