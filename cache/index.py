"""Longest exact prefix over thousands of recorded entries.

Every entry registers the parent-chained hashes of its full `block`-token runs
(identity.block_chain). A query hashes its own runs once, then a binary search over
depth finds the deepest run hash any entry shares; the candidates there are confirmed
by comparing tokens exactly. Hashes only rank: if no candidate confirms (a collision),
the index falls back to an exact scan of the stage's entries, so it never returns a
wrong prefix and never misses a right one.

Not thread-safe by itself: it is owned by one PrefixCache, which calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .identity import block_chain


@dataclass(frozen=True)
class Match:
    entry_id: int
    length: int   # tokens shared with the query: a multiple of the block


@dataclass
class _Entry:
    stage: bytes
    tokens: tuple[int, ...]
    chain: list[bytes]


class PrefixIndex:
    def __init__(self, block: int, hash_fn=None):
        if block < 1:
            raise ValueError("block must be >= 1")
        self.block = block
        self._hash_fn = hash_fn
        self._entries: dict[int, _Entry] = {}
        self._by_stage: dict[bytes, set[int]] = {}
        self._at: dict[bytes, set[int]] = {}    # run hash at depth d -> entries through it
        self._ends: dict[bytes, set[int]] = {}  # run hash at an entry's full length
        self.collisions = 0                      # hash hits that failed verification

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry_id: int) -> bool:
        return entry_id in self._entries

    def chain(self, stage: bytes, tokens: Sequence[int]) -> list[bytes]:
        return block_chain(stage, tokens, self.block, self._hash_fn)

    def insert(self, entry_id: int, stage: bytes, tokens: Sequence[int],
               chain: list[bytes] | None = None) -> None:
        """Record an entry; its token count must be a multiple of the block."""
        if entry_id in self._entries:
            raise KeyError(f"entry {entry_id} is already indexed")
        tokens = tuple(tokens)
        if not tokens or len(tokens) % self.block:
            raise ValueError(f"entry length {len(tokens)} is not a positive multiple of "
                             f"{self.block}")
        chain = chain if chain is not None else self.chain(stage, tokens)
        self._entries[entry_id] = _Entry(stage, tokens, chain)
        self._by_stage.setdefault(stage, set()).add(entry_id)
        for h in chain:
            self._at.setdefault(h, set()).add(entry_id)
        self._ends.setdefault(chain[-1], set()).add(entry_id)

    def remove(self, entry_id: int) -> None:
        e = self._entries.pop(entry_id)
        _discard(self._by_stage, e.stage, entry_id)
        for h in e.chain:
            _discard(self._at, h, entry_id)
        _discard(self._ends, e.chain[-1], entry_id)

    def tokens(self, entry_id: int) -> tuple[int, ...]:
        return self._entries[entry_id].tokens

    def find_exact(self, stage: bytes, tokens: Sequence[int],
                   chain: list[bytes] | None = None) -> int | None:
        """The entry holding exactly these tokens, if any."""
        tokens = tuple(tokens)
        if not tokens or len(tokens) % self.block:
            return None
        chain = chain if chain is not None else self.chain(stage, tokens)
        for eid in self._ends.get(chain[-1], ()):
            e = self._entries[eid]
            if e.stage == stage and e.tokens == tokens:
                return eid
        return None

    def longest(self, stage: bytes, query: Sequence[int], *, max_len: int | None = None,
                whole_entry: bool = False, query_chain: list[bytes] | None = None,
                prefer=None) -> Match | None:
        """The longest prefix of `query` (at most max_len tokens, block-aligned) held by
        an entry of `stage`.

        whole_entry=False: an entry serves any block-aligned prefix it shares with the
        query (resident KV: copy its first rows). whole_entry=True: only entries whose
        whole token list is a prefix of the query (snapshots taken at one boundary).
        `prefer(entry_id)` ranks equally long candidates (highest wins)."""
        limit = len(query) if max_len is None else min(max_len, len(query))
        depth = limit // self.block
        if depth == 0 or stage not in self._by_stage:
            return None
        chain = query_chain if query_chain is not None else self.chain(stage, query[: depth * self.block])
        chain = chain[:depth]
        found, collided = self._search(stage, query, chain, whole_entry, prefer)
        if collided:
            self.collisions += 1
            return self._scan(stage, query, depth, whole_entry, prefer)
        return found

    # -- internals -------------------------------------------------------------------------
    def _confirm(self, stage, query, ids, d, prefer, whole_entry=False) -> Match | None:
        n = d * self.block
        want = tuple(query[:n])
        ok = [eid for eid in ids
              if self._entries[eid].stage == stage and self._entries[eid].tokens[:n] == want
              and (not whole_entry or len(self._entries[eid].tokens) == n)]
        if not ok:
            return None
        return Match(max(ok, key=prefer) if prefer else max(ok), n)

    def _search(self, stage, query, chain, whole_entry, prefer) -> tuple[Match | None, bool]:
        """(verified match, whether a hash hit failed verification)."""
        # Deepest depth whose run hash some entry shares: genuine sharing is monotone in
        # depth (an entry through depth d is through every shallower one), collisions can
        # only add presence, so the search lands at or past the genuine deepest depth.
        lo, hi = 0, len(chain) + 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if chain[mid - 1] in self._at:
                lo = mid
            else:
                hi = mid
        if lo == 0:
            return None, False
        if not whole_entry:
            m = self._confirm(stage, query, self._at[chain[lo - 1]], lo, prefer)
            return m, m is None
        for d in range(lo, 0, -1):
            ids = self._ends.get(chain[d - 1])
            if ids:
                m = self._confirm(stage, query, ids, d, prefer, whole_entry=True)
                if m is not None:
                    return m, False
                return None, True
        return None, False

    def _scan(self, stage, query, depth, whole_entry, prefer) -> Match | None:
        """Exact, hash-free answer: the fallback after a collision."""
        best: Match | None = None
        b = self.block
        for eid in self._by_stage.get(stage, ()):
            tokens = self._entries[eid].tokens
            d = 0
            while d < depth and d * b < len(tokens) and \
                    tokens[d * b:(d + 1) * b] == tuple(query[d * b:(d + 1) * b]):
                d += 1
            if whole_entry and d * b != len(tokens):
                continue
            if d == 0:
                continue
            n = d * b
            if best is None or n > best.length or (
                    n == best.length and (prefer(eid) if prefer else eid) >
                    (prefer(best.entry_id) if prefer else best.entry_id)):
                best = Match(eid, n)
        return best


def _discard(table: dict, key, entry_id: int) -> None:
    ids = table.get(key)
    if ids is not None:
        ids.discard(entry_id)
        if not ids:
            del table[key]
