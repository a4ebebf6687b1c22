"""The prefix cache of one stage and one payload kind: lookup, record, evict.

It composes the prefix index (which entry holds the longest exact prefix), the resident
LRU (which entries may live under the caps), admission (capture only what recurs) and
counters. The caller owns the bytes: it restores a hit's state into a lane, stores the
state of a reservation, and drops the state of every evicted entry id it is handed.

Lock discipline (the same for every object in `cache/`): each cache object guards its
state with one lock of its own and never calls another cache object while holding it,
so locks never nest and cannot deadlock. Here admission is consulted before the lock is
taken; the index and the LRU are plain structures used only under this lock.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from .admission import PrefixAdmission
from .config import CacheConfig
from .identity import prefix_digest
from .index import STEM_TOKENS, PrefixIndex, Query
from .resident import Refused, ResidentLru
from .telemetry import CacheStats, Counters, snapshot


@dataclass(frozen=True)
class Hit:
    entry_id: int
    length: int   # leading tokens of the query whose state the entry holds
    kind: str


@dataclass(frozen=True)
class Reservation:
    entry_id: int
    query: Query               # the prepared tokens, hashed once at reserve
    evicted: tuple[int, ...]   # entry ids whose state the caller must drop now

    @property
    def n_tokens(self) -> int:
        return self.query.n_tokens


class PrefixCache:
    def __init__(self, *, block: int, max_entries: int, max_bytes: int,
                 max_tokens: int | None = None, kind: str = "ResidentKv",
                 whole_entry: bool = False, admission: PrefixAdmission | None = None,
                 hash_fn=None, granular: bool = False, stem: int = STEM_TOKENS):
        """block: the reuse granularity in tokens (the config's stride). whole_entry:
        an entry serves only queries that contain all its tokens (snapshots taken at
        one boundary, KvRecurrent); otherwise any block-aligned shared prefix (KV rows).
        granular (row-invariant stages): entries of any length of at least a block,
        serving any shared prefix to the token (whole entries: any that the query holds),
        down to `stem` tokens. admission None: every reservation is admitted (the caller
        decided)."""
        self.kind, self.block, self.whole_entry = kind, block, whole_entry
        self.granular = granular
        self.max_tokens = max_tokens
        self._index = PrefixIndex(block, hash_fn, granular=granular, stem=stem)
        self._lru = ResidentLru(max_entries, max_bytes)
        self._admission = admission
        self._counters = Counters()
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: CacheConfig, *, kind: str = "ResidentKv",
                    whole_entry: bool = False) -> "PrefixCache":
        """The prefix cache a stage runs with `config`: reuse granularity = stride."""
        return cls(block=config.stride, max_entries=config.max_entries,
                   max_bytes=config.max_bytes, max_tokens=config.max_tokens_per_entry,
                   kind=kind, whole_entry=whole_entry,
                   admission=PrefixAdmission(config.admit_after))

    # -- reading ---------------------------------------------------------------------------
    def lookup(self, stage: bytes, tokens: Sequence[int], *, max_len: int | None = None,
               probe: bool = False) -> Hit | None:
        """The longest cached prefix of `tokens` (at most max_len tokens), pinned until
        `release(hit)`. A probe (warm-up, health) never hits, counts or refreshes."""
        if probe:
            with self._lock:
                self._counters.probes += 1
            return None
        q = self._index.prepare(stage, tokens, max_len)
        with self._lock:
            self._counters.lookups += 1
            before = self._index.collisions
            m = self._index.longest(q, whole_entry=self.whole_entry)
            self._counters.collisions += self._index.collisions - before
            if m is None:
                self._counters.misses += 1
                return None
            self._lru.pin(m.entry_id)
            self._lru.touch(m.entry_id)
            self._counters.hits += 1
            self._counters.hit_tokens += m.length
            return Hit(m.entry_id, m.length, self.kind)

    def release(self, hit: Hit) -> list[int]:
        """Unpin a hit; returns entry ids freed by it (removed while pinned)."""
        with self._lock:
            freed = self._lru.unpin(hit.entry_id)
            self._forget(freed, evicted=False)
            return freed

    def tokens(self, entry_id: int) -> tuple[int, ...]:
        with self._lock:
            return self._index.tokens(entry_id)

    # -- recording -------------------------------------------------------------------------
    def reserve(self, stage: bytes, tokens: Sequence[int], nbytes: int, *,
                probe: bool = False) -> Reservation | None:
        """Room for the state of `tokens` (a block-aligned prefix; granular: at least a
        block), or None: a probe, an identity already held (refreshed instead), not
        admitted yet, too large, or only pinned entries to evict. The caller stores the
        state, then commits."""
        if probe or not self._index.fits(len(tokens)):
            return None
        q = self._index.prepare(stage, tokens)
        with self._lock:
            existing = self._index.find_exact(q)
            if existing is not None:
                self._lru.touch(existing)
                self._counters.refreshes += 1
                return None
            if self.max_tokens is not None and len(tokens) > self.max_tokens:
                self._counters.bypasses += 1
                return None
        if self._admission is not None and not self._admission.observe(
                prefix_digest(stage, q.raw)):
            with self._lock:
                self._counters.not_admitted += 1
            return None
        with self._lock:
            try:
                entry_id, evicted = self._lru.allocate(nbytes)
            except Refused:
                self._counters.bypasses += 1
                return None
            self._forget(evicted)
            self._counters.admissions += 1
            return Reservation(entry_id, q, tuple(evicted))

    def commit(self, r: Reservation) -> bool:
        """Make a reservation readable. False (and the slot freed) when another
        reservation recorded the same identity first: the caller drops its copy."""
        with self._lock:
            if r.entry_id not in self._lru or r.entry_id in self._index:
                return False
            if self._index.find_exact(r.query) is not None:
                self._lru.remove(r.entry_id)
                self._counters.refreshes += 1
                return False
            self._lru.commit(r.entry_id)
            self._index.insert(r.entry_id, r.query)
            self._counters.records += 1
            return True

    def abort(self, r: Reservation) -> list[int]:
        """Give a reservation up (its state could not be stored). On an entry already
        committed this is a remove: it never leaves an index entry without a slot."""
        return self.remove(r.entry_id)

    # -- evicting --------------------------------------------------------------------------
    def remove(self, entry_id: int) -> list[int]:
        """Drop an entry (e.g. its state failed to restore); pinned ones go at release."""
        with self._lock:
            freed = self._lru.remove(entry_id)
            self._forget(freed, evicted=False)
            if entry_id in self._index and entry_id not in freed:
                self._index.remove(entry_id)   # doomed: invisible to new lookups now
            return freed

    def clear(self) -> list[int]:
        with self._lock:
            ids = [eid for eid in self._lru.lru_order()]
            freed = self._lru.clear()
            self._forget(freed, evicted=False)
            for eid in ids:
                if eid in self._index:
                    self._index.remove(eid)
            return freed

    def stats(self) -> CacheStats:
        with self._lock:
            u = self._lru.usage()
            return CacheStats(self.kind, u.entries, u.resident_bytes, u.reserved_bytes,
                              u.evictable_bytes, u.pinned_entries, snapshot(self._counters))

    # -- internals (under the lock) --------------------------------------------------------
    def _forget(self, freed: list[int], evicted: bool = True) -> None:
        for eid in freed:
            if eid in self._index:
                self._index.remove(eid)
        if evicted:
            self._counters.evictions += len(freed)

