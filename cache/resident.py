"""Resident entries: LRU bookkeeping under entry and byte caps, with pins and reservations.

The runtime holds the bytes (KV rows, frames); this module only decides which entries
live. An entry is first *reserved* (its bytes are counted but it cannot be evicted or
read), then *committed* (resident, evictable unless pinned). Allocation returns the
entries it evicted so the caller drops their state. An allocation that could only fit
by evicting pinned or reserved entries is refused and evicts nothing: the caller
bypasses the cache. A pinned entry is never freed under its reader: removing or
clearing it only dooms it, and it is freed (reported by `unpin`) when the last pin goes.

Not thread-safe by itself: owned by one cache object, which calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


class Refused(Exception):
    """The allocation cannot fit without evicting pinned or reserved entries."""


@dataclass
class Slot:
    entry_id: int
    nbytes: int
    committed: bool = False
    pins: int = 0
    doomed: bool = False   # removed while pinned: freed at the last unpin


@dataclass(frozen=True)
class ResidentUsage:
    entries: int
    resident_bytes: int    # committed entries
    reserved_bytes: int    # reserved, not yet committed
    evictable_bytes: int   # committed and unpinned: what an allocation may reclaim
    pinned_entries: int


class ResidentLru:
    def __init__(self, max_entries: int, max_bytes: int):
        if max_entries < 0 or max_bytes < 0:
            raise ValueError("caps must be >= 0")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._slots: OrderedDict[int, Slot] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._next_id = 1

    def __contains__(self, entry_id: int) -> bool:
        s = self._slots.get(entry_id)
        return s is not None and not s.doomed

    def __len__(self) -> int:
        return len(self._slots)

    def slot(self, entry_id: int) -> Slot:
        return self._slots[entry_id]

    def allocate(self, nbytes: int) -> tuple[int, list[int]]:
        """Reserve room for a new entry: (entry id, evicted entry ids). Raises Refused."""
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        if self.max_entries == 0 or nbytes > self.max_bytes:
            raise Refused("entry larger than the cache")
        victims, freed_bytes, freed_entries = [], 0, 0
        need_entries = len(self._slots) + 1 - self.max_entries
        need_bytes = self._bytes + nbytes - self.max_bytes
        for eid, s in self._slots.items():  # LRU first
            if need_entries - freed_entries <= 0 and need_bytes - freed_bytes <= 0:
                break
            if s.committed and s.pins == 0:
                victims.append(eid)
                freed_entries += 1
                freed_bytes += s.nbytes
        if need_entries - freed_entries > 0 or need_bytes - freed_bytes > 0:
            raise Refused("only pinned or reserved entries could make room")
        for eid in victims:
            self._drop(eid)
        eid = self._next_id
        self._next_id += 1
        self._slots[eid] = Slot(eid, nbytes)
        self._bytes += nbytes
        return eid, victims

    def commit(self, entry_id: int) -> None:
        s = self._slots[entry_id]
        s.committed = True
        self._slots.move_to_end(entry_id)

    def touch(self, entry_id: int) -> None:
        self._slots.move_to_end(entry_id)

    def pin(self, entry_id: int) -> None:
        s = self._slots[entry_id]
        if not s.committed or s.doomed:
            raise KeyError(f"entry {entry_id} is not readable")
        s.pins += 1

    def unpin(self, entry_id: int) -> list[int]:
        """Drop one pin; returns [entry_id] if that freed a doomed entry."""
        s = self._slots[entry_id]
        if s.pins <= 0:
            raise ValueError(f"entry {entry_id} is not pinned")
        s.pins -= 1
        if s.pins == 0 and s.doomed:
            self._drop(entry_id)
            return [entry_id]
        return []

    def remove(self, entry_id: int) -> list[int]:
        """Free an entry (a reservation aborts this way too); a pinned one is doomed and
        freed at its last unpin. Returns the ids freed now."""
        s = self._slots.get(entry_id)
        if s is None or s.doomed:
            return []
        if s.pins:
            s.doomed = True
            return []
        self._drop(entry_id)
        return [entry_id]

    def clear(self) -> list[int]:
        freed = []
        for eid in list(self._slots):
            freed += self.remove(eid)
        return freed

    def lru_order(self) -> list[int]:
        return list(self._slots)

    def usage(self) -> ResidentUsage:
        resident = reserved = evictable = pinned = 0
        for s in self._slots.values():
            if s.committed:
                resident += s.nbytes
                if s.pins == 0:
                    evictable += s.nbytes
                else:
                    pinned += 1
            else:
                reserved += s.nbytes
        return ResidentUsage(len(self._slots), resident, reserved, evictable, pinned)

    def _drop(self, entry_id: int) -> None:
        s = self._slots.pop(entry_id)
        self._bytes -= s.nbytes
