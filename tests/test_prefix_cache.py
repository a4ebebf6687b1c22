"""The prefix cache against a brute-force oracle, under random operation sequences.

The oracle keeps plain lists and answers every question by scanning: longest shared
block-aligned prefix (granular: to the token, at least a block, or a stem of STEM tokens
where the entry is at least a block), LRU eviction under caps,
pins that hold entries alive. The cache
must give the same answer after every step, with any hash function (even one that
collides on everything), and its caps must hold throughout.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from skippy.cache.prefix_cache import PrefixCache

BLOCK = 4
MAX_ENTRIES = 5
MAX_BYTES = 100
MAX_TOKENS = 16
STEM = 2  # a granular index's shortest match (shorter than the block)
STAGES = (b"stage-a", b"stage-b")

tokens_st = st.lists(st.integers(0, 2), min_size=0, max_size=24)  # tiny alphabet: deep sharing


def constant_hash(parent: bytes, run: bytes) -> bytes:
    return b"\x00" * 16


def first_token_hash(parent: bytes, run: bytes) -> bytes:
    return bytes([len(parent) % 7, run[0]]) + b"\x00" * 14


class Oracle:
    def __init__(self, whole_entry: bool, granular: bool = False):
        self.whole_entry, self.granular = whole_entry, granular
        self.entries: dict[int, dict] = {}
        self.order: list[int] = []   # LRU first

    def live(self, stage):
        return [e for e in self.entries.values()
                if e["stage"] == stage and e["committed"] and not e["doomed"]]

    def longest(self, stage, query, max_len):
        limit = len(query) if max_len is None else min(max_len, len(query))
        best = None
        for e in self.live(stage):
            n, step = 0, 1 if self.granular else BLOCK
            while n + step <= min(limit, len(e["tokens"])) and \
                    e["tokens"][n:n + step] == tuple(query[n:n + step]):
                n += step
            if self.whole_entry and n != len(e["tokens"]):
                continue
            shortest = STEM if self.granular and not self.whole_entry else BLOCK
            if n >= shortest and (best is None or (n, e["id"]) > best):
                best = (n, e["id"])
        return best

    def touch(self, eid):
        self.order.remove(eid)
        self.order.append(eid)

    def used(self):
        return sum(e["nbytes"] for e in self.entries.values())

    def allocate(self, eid, nbytes):
        if nbytes > MAX_BYTES:
            return None
        victims, entries, used = [], len(self.entries) + 1, self.used() + nbytes
        for v in self.order:
            if entries <= MAX_ENTRIES and used <= MAX_BYTES:
                break
            e = self.entries[v]
            if e["committed"] and e["pins"] == 0:
                victims.append(v)
                entries -= 1
                used -= e["nbytes"]
        if entries > MAX_ENTRIES or used > MAX_BYTES:
            return None
        for v in victims:
            self.drop(v)
        return victims

    def drop(self, eid):
        del self.entries[eid]
        self.order.remove(eid)


class CacheMachine(RuleBasedStateMachine):
    whole_entry = False
    granular = False
    hash_fn = None

    def __init__(self):
        super().__init__()
        self.cache = PrefixCache(block=BLOCK, max_entries=MAX_ENTRIES, max_bytes=MAX_BYTES,
                                 max_tokens=MAX_TOKENS, whole_entry=self.whole_entry,
                                 hash_fn=self.hash_fn, granular=self.granular, stem=STEM)
        self.oracle = Oracle(self.whole_entry, self.granular)
        self.held = []

    @rule(stage=st.sampled_from(STAGES), tokens=tokens_st, nbytes=st.integers(0, 60))
    def record(self, stage, tokens, nbytes):
        tokens = tuple(tokens if self.granular else tokens[: len(tokens) // BLOCK * BLOCK])
        r = self.cache.reserve(stage, tokens, nbytes)
        o = self.oracle
        existing = [e for e in o.live(stage) if e["tokens"] == tokens]
        if len(tokens) < BLOCK:
            assert r is None
        elif existing:
            assert r is None
            o.touch(existing[0]["id"])
        elif len(tokens) > MAX_TOKENS:
            assert r is None
        else:
            victims = o.allocate(None, nbytes)
            if victims is None:
                assert r is None
                return
            assert r is not None and sorted(r.evicted) == sorted(victims)
            o.entries[r.entry_id] = {"id": r.entry_id, "stage": stage, "tokens": tokens,
                                     "nbytes": nbytes, "committed": False, "pins": 0,
                                     "doomed": False}
            o.order.append(r.entry_id)
            assert self.cache.commit(r)
            o.entries[r.entry_id]["committed"] = True
            o.touch(r.entry_id)

    @rule(stage=st.sampled_from(STAGES), query=tokens_st,
          max_len=st.one_of(st.none(), st.integers(0, 24)))
    def lookup(self, stage, query, max_len):
        hit = self.cache.lookup(stage, query, max_len=max_len)
        expected = self.oracle.longest(stage, query, max_len)
        if expected is None:
            assert hit is None
            return
        assert hit is not None and (hit.length, hit.entry_id) == expected
        assert self.cache.tokens(hit.entry_id)[: hit.length] == tuple(query[: hit.length])
        self.oracle.entries[hit.entry_id]["pins"] += 1
        self.oracle.touch(hit.entry_id)
        self.held.append(hit)

    # Random lists rarely share prefixes: derive some records and queries from what is
    # held, so deep sharing, ties and partial matches happen often.
    def _near(self, i, cut, tail):
        e = self.oracle.entries[sorted(self.oracle.entries)[i % len(self.oracle.entries)]]
        return e["stage"], list(e["tokens"][: cut % (len(e["tokens"]) + 1)]) + tail

    @precondition(lambda self: self.oracle.entries)
    @rule(i=st.integers(0, 100), cut=st.integers(0, 24), tail=tokens_st,
          nbytes=st.integers(0, 40))
    def record_near(self, i, cut, tail, nbytes):
        stage, tokens = self._near(i, cut, tail)
        self.record(stage, tokens, nbytes)

    @precondition(lambda self: self.oracle.entries)
    @rule(i=st.integers(0, 100), cut=st.integers(0, 24), tail=tokens_st,
          max_len=st.one_of(st.none(), st.integers(0, 24)))
    def lookup_near(self, i, cut, tail, max_len):
        stage, query = self._near(i, cut, tail)
        self.lookup(stage, query, max_len)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def release(self, i):
        hit = self.held.pop(i % len(self.held))
        freed = self.cache.release(hit)
        e = self.oracle.entries[hit.entry_id]
        e["pins"] -= 1
        if e["pins"] == 0 and e["doomed"]:
            self.oracle.drop(hit.entry_id)
            assert freed == [hit.entry_id]
        else:
            assert freed == []

    @precondition(lambda self: self.oracle.entries)
    @rule(i=st.integers(0, 100))
    def remove(self, i):
        ids = sorted(self.oracle.entries)
        eid = ids[i % len(ids)]
        freed = self.cache.remove(eid)
        e = self.oracle.entries[eid]
        if e["doomed"]:
            assert freed == []
        elif e["pins"]:
            e["doomed"] = True
            assert freed == []
        else:
            self.oracle.drop(eid)
            assert freed == [eid]

    @rule()
    def clear(self):
        freed = self.cache.clear()
        expected = []
        for eid in list(self.oracle.order):
            e = self.oracle.entries[eid]
            if e["pins"]:
                e["doomed"] = True
            else:
                self.oracle.drop(eid)
                expected.append(eid)
        assert sorted(freed) == sorted(expected)

    @invariant()
    def caps_hold_and_accounting_matches(self):
        s = self.cache.stats()
        assert s.entries == len(self.oracle.entries) <= MAX_ENTRIES
        assert s.resident_bytes + s.reserved_bytes == self.oracle.used() <= MAX_BYTES
        assert s.pinned_entries == sum(1 for e in self.oracle.entries.values() if e["pins"])


SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


class PartialReuse(CacheMachine):
    pass


class WholeEntry(CacheMachine):
    whole_entry = True


class PartialReuseConstantHash(CacheMachine):
    hash_fn = staticmethod(constant_hash)


class WholeEntryConstantHash(CacheMachine):
    whole_entry = True
    hash_fn = staticmethod(constant_hash)


class PartialReuseWeakHash(CacheMachine):
    hash_fn = staticmethod(first_token_hash)


class Granular(CacheMachine):
    granular = True


class GranularConstantHash(CacheMachine):
    granular = True
    hash_fn = staticmethod(constant_hash)


class GranularWeakHash(CacheMachine):
    granular = True
    hash_fn = staticmethod(first_token_hash)


class GranularWholeEntry(CacheMachine):
    granular = True
    whole_entry = True


class GranularWholeEntryConstantHash(CacheMachine):
    granular = True
    whole_entry = True
    hash_fn = staticmethod(constant_hash)


TestPartialReuse = PartialReuse.TestCase
TestWholeEntry = WholeEntry.TestCase
TestCollidingHashNeverGivesAWrongHit = PartialReuseConstantHash.TestCase
TestCollidingHashWholeEntry = WholeEntryConstantHash.TestCase
TestWeakHash = PartialReuseWeakHash.TestCase
TestGranularReuseRunsToTheToken = Granular.TestCase
TestGranularCollidingHash = GranularConstantHash.TestCase
TestGranularWeakHash = GranularWeakHash.TestCase
TestGranularWholeEntry = GranularWholeEntry.TestCase
TestGranularWholeEntryCollidingHash = GranularWholeEntryConstantHash.TestCase
for case in (TestPartialReuse, TestWholeEntry, TestCollidingHashNeverGivesAWrongHit,
             TestCollidingHashWholeEntry, TestWeakHash, TestGranularReuseRunsToTheToken,
             TestGranularCollidingHash, TestGranularWeakHash, TestGranularWholeEntry,
             TestGranularWholeEntryCollidingHash):
    case.settings = SETTINGS
del case
