"""Longest exact prefix over thousands of recorded entries.

Every entry registers the parent-chained hashes of its full `block`-token runs
(identity.block_chain). A query is prepared once (its tokens as bytes and its own run
hashes: the only per-token work); a binary search over depth then finds the deepest run
hash any entry shares, and candidates there are confirmed newest first by comparing
token bytes exactly, stopping at the first that confirms. Hashes only rank: if a hash
hit fails to confirm (a collision), the index falls back to an exact scan of the stage's
entries, so it never returns a wrong prefix and never misses a right one.

A granular index (row-invariant stages, DESIGN.md §5.3) also holds entries of any length
of at least one block, and a match runs to the token: past the deepest shared run, the
candidates' tokens are compared with the query's (fewer than a block of them, unless a
hash collided). It also finds a stem shorter than a block, of `stem` tokens or more (a
short system prompt, a template's header): each entry is also kept under its first d
tokens for every d from `stem` to the block (their bytes, with the stage: no hash to
confirm), and a binary search over d finds the deepest any entry shares with the query
(exactly that deep, so the newest there wins): a few dictionary probes, however many
entries share a header, for about 8 KiB of keys an entry (64-token blocks).

Not thread-safe by itself: it is owned by one PrefixCache, which calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .identity import TOKEN_BYTES, block_chain_bytes, token_bytes

STEM_TOKENS = 8  # a granular index's shortest match by default


@dataclass(frozen=True)
class Match:
    entry_id: int
    length: int   # tokens shared with the query: a multiple of the block unless granular


@dataclass(frozen=True)
class Query:
    """A token sequence prepared for lookups: little-endian int32 bytes and run hashes."""

    stage: bytes
    raw: bytes
    chain: tuple[bytes, ...]

    @property
    def n_tokens(self) -> int:
        return len(self.raw) // TOKEN_BYTES


@dataclass
class _Entry:
    stage: bytes
    raw: bytes
    chain: tuple[bytes, ...]


class PrefixIndex:
    def __init__(self, block: int, hash_fn=None, *, granular: bool = False,
                 stem: int = STEM_TOKENS):
        """stem: a granular index's shortest match, where shorter than a block."""
        if block < 1 or stem < 1:
            raise ValueError("block and stem must be >= 1")
        self.block, self.granular, self.stem = block, granular, stem
        self._hash_fn = hash_fn
        self._entries: dict[int, _Entry] = {}
        self._by_stage: dict[bytes, dict[int, None]] = {}
        # run hash -> entries through it, in insertion order (newest last)
        self._at: dict[bytes, dict[int, None]] = {}
        self._ends: dict[bytes, dict[int, None]] = {}  # run hash at an entry's full length
        # granular: (stage, first d tokens) -> entries, for d in [stem, block)
        self._stems: dict[tuple[bytes, bytes], dict[int, None]] = {}
        self.collisions = 0                             # hash hits that failed to confirm

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry_id: int) -> bool:
        return entry_id in self._entries

    def prepare(self, stage: bytes, tokens: Sequence[int], max_len: int | None = None) -> Query:
        """The query form of `tokens` (at most max_len of them); all hashing happens here."""
        n = len(tokens) if max_len is None else max(0, min(max_len, len(tokens)))
        raw = token_bytes(tokens[:n])
        return Query(stage, raw, tuple(block_chain_bytes(stage, raw, self.block, self._hash_fn)))

    def insert(self, entry_id: int, q: Query) -> None:
        """Record an entry holding exactly q's tokens (a positive multiple of the block;
        granular: at least one block)."""
        if entry_id in self._entries:
            raise KeyError(f"entry {entry_id} is already indexed")
        if not self.fits(q.n_tokens):
            raise ValueError(f"entry length {q.n_tokens} is not "
                             + (f"at least {self.block}" if self.granular else
                                f"a positive multiple of {self.block}"))
        self._entries[entry_id] = _Entry(q.stage, q.raw, q.chain)
        self._by_stage.setdefault(q.stage, {})[entry_id] = None
        for h in q.chain:
            self._at.setdefault(h, {})[entry_id] = None
        self._ends.setdefault(q.chain[-1], {})[entry_id] = None
        if self.granular:
            for key in self._stem_keys(q.stage, q.raw):
                self._stems.setdefault(key, {})[entry_id] = None

    def remove(self, entry_id: int) -> None:
        e = self._entries.pop(entry_id)
        _discard(self._by_stage, e.stage, entry_id)
        for h in e.chain:
            _discard(self._at, h, entry_id)
        _discard(self._ends, e.chain[-1], entry_id)
        if self.granular:
            for key in self._stem_keys(e.stage, e.raw):
                _discard(self._stems, key, entry_id)

    def fits(self, n_tokens: int) -> bool:
        """Whether an entry may hold n_tokens tokens."""
        if self.granular:
            return n_tokens >= self.block
        return n_tokens > 0 and n_tokens % self.block == 0

    def tokens(self, entry_id: int) -> tuple[int, ...]:
        raw = self._entries[entry_id].raw
        return tuple(memoryview(raw).cast("i"))

    def find_exact(self, q: Query) -> int | None:
        """The entry holding exactly q's tokens, if any."""
        if not self.fits(q.n_tokens):
            return None
        for eid in reversed(self._ends.get(q.chain[-1], {})):
            e = self._entries[eid]
            if e.stage == q.stage and e.raw == q.raw:
                return eid
        return None

    def longest(self, q: Query, *, whole_entry: bool = False) -> Match | None:
        """The longest block-aligned prefix of the prepared query held by an entry of its
        stage; among equally long ones, the newest entry.

        whole_entry=False: an entry serves any block-aligned prefix it shares with the
        query (resident KV: copy its first rows), on a granular index any prefix, a stem
        shorter than a block included.
        whole_entry=True: only entries whose whole token list is a prefix of the query
        (snapshots taken at one boundary)."""
        if q.stage not in self._by_stage:
            return None
        if not q.chain or q.chain[0] not in self._at:  # no whole block shared
            return self._stem_match(q) if self.granular and not whole_entry else None
        found, collided = self._search(q, whole_entry)
        if collided:
            self.collisions += 1
            return self._scan(q, whole_entry)
        return found

    # -- internals -------------------------------------------------------------------------
    def _confirm(self, q: Query, ids: dict, depth: int, whole_entry: bool) -> Match | None:
        n = depth * self.block * TOKEN_BYTES
        # A memoryview slice avoids a copy; startswith compares with memcmp (memoryview
        # equality would unpack element by element: evals/README.md, bench_cache).
        want = memoryview(q.raw)[:n]
        for eid in reversed(ids):  # newest first; the first that confirms wins
            e = self._entries[eid]
            if e.stage == q.stage and (not whole_entry or len(e.raw) == n) and \
                    e.raw.startswith(want):
                return Match(eid, depth * self.block)
        return None

    def _extend(self, q: Query, ids: dict, m: Match) -> Match:
        """The longest token run any of `ids` shares with the query past m (newest first
        among equals)."""
        n = m.length * TOKEN_BYTES
        best = m
        for eid in reversed(ids):
            e = self._entries[eid]
            if e.stage == q.stage and e.raw.startswith(memoryview(q.raw)[:n]):
                shared = _shared(e.raw, q.raw, m.length)
                if shared > best.length:
                    best = Match(eid, shared)
        return best

    def _search(self, q: Query, whole_entry: bool) -> tuple[Match | None, bool]:
        """(confirmed match, whether a hash hit failed to confirm)."""
        # Deepest depth whose run hash some entry shares: genuine sharing is monotone in
        # depth (an entry through depth d is through every shallower one), collisions can
        # only add presence, so the search lands at or past the genuine deepest depth.
        chain = q.chain
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
            ids = self._at[chain[lo - 1]]
            m = self._confirm(q, ids, lo, False)
            if m is not None and self.granular:
                m = self._extend(q, ids, m)
            return m, m is None
        for d in range(lo, 0, -1):
            ids = self._ends.get(chain[d - 1])
            if ids and self.granular:
                m, genuine = self._whole_within(q, ids, d)
                if m is not None or not genuine:
                    return m, m is None
            elif ids:
                m = self._confirm(q, ids, d, True)
                return m, m is None
        return None, False

    def _whole_within(self, q: Query, ids: dict, depth: int) -> tuple[Match | None, bool]:
        """Granular whole entries ending within the block after `depth` full ones: (the
        longest whose every token the query holds, whether any shares the query's first
        `depth` blocks: none means the hash hit was a collision)."""
        head = memoryview(q.raw)[:depth * self.block * TOKEN_BYTES]
        best, genuine = None, False
        for eid in reversed(ids):  # newest first
            e = self._entries[eid]
            if e.stage != q.stage or not e.raw.startswith(head):
                continue
            genuine = True
            if q.raw.startswith(e.raw) and (best is None or len(e.raw) > best.length * TOKEN_BYTES):
                best = Match(eid, len(e.raw) // TOKEN_BYTES)
        return best, genuine

    def _stem_keys(self, stage: bytes, raw: bytes) -> list[tuple[bytes, bytes]]:
        top = min(self.block, len(raw) // TOKEN_BYTES + 1)
        return [(stage, raw[:d * TOKEN_BYTES]) for d in range(self.stem, top)]

    def _stem_match(self, q: Query) -> Match | None:
        """The deepest run shorter than a block, of at least `stem` tokens, that an entry
        of the query's stage shares with it (the newest such entry). Sharing is monotone
        in depth, so a binary search finds it."""
        lo, hi = self.stem - 1, min(self.block, q.n_tokens + 1)  # lo: shared; hi: not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if (q.stage, q.raw[:mid * TOKEN_BYTES]) in self._stems:
                lo = mid
            else:
                hi = mid
        if lo < self.stem:
            return None
        ids = self._stems[(q.stage, q.raw[:lo * TOKEN_BYTES])]
        return Match(next(reversed(ids)), lo)

    def _scan(self, q: Query, whole_entry: bool) -> Match | None:
        """Exact, hash-free answer: the fallback after a collision."""
        best: Match | None = None
        for eid in self._by_stage.get(q.stage, {}):  # oldest first: later equals win
            raw = self._entries[eid].raw
            n = _shared(raw, q.raw, 0)
            if not self.granular:
                n = n // self.block * self.block
            shortest = min(self.stem, self.block) if self.granular and not whole_entry \
                else self.block
            if n < shortest or (whole_entry and n * TOKEN_BYTES != len(raw)):
                continue
            if best is None or n >= best.length:
                best = Match(eid, n)
        return best


def _shared(a: bytes, b: bytes, known: int) -> int:
    """Tokens a and b share from the start, given that they share the first `known`:
    found by halving, each test one memcmp."""
    lo, hi = known, min(len(a), len(b)) // TOKEN_BYTES
    view = memoryview(b)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a.startswith(view[known * TOKEN_BYTES:mid * TOKEN_BYTES], known * TOKEN_BYTES):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _discard(table: dict, key, entry_id: int) -> None:
    ids = table.get(key)
    if ids is not None:
        ids.pop(entry_id, None)
        if not ids:
            del table[key]
