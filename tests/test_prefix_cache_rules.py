"""The prefix cache's rules, one example each (the oracle test covers the space)."""

from skippy.cache.admission import PrefixAdmission
from skippy.cache.prefix_cache import PrefixCache

S = b"stage"
SYSTEM = list(range(100, 164))  # one shared 64-token block


def cache(**kw) -> PrefixCache:
    return PrefixCache(**{"block": 64, "max_entries": 8, "max_bytes": 1000, **kw})


def record(c, tokens, nbytes=10):
    r = c.reserve(S, tokens, nbytes)
    assert r is not None and c.commit(r)
    return r


def test_longest_block_aligned_prefix_wins():
    c = cache()
    short = record(c, SYSTEM)
    long = record(c, SYSTEM + list(range(64)))
    hit = c.lookup(S, SYSTEM + list(range(64)) + [7] * 10)
    assert (hit.entry_id, hit.length) == (long.entry_id, 128)
    c.release(hit)
    hit = c.lookup(S, SYSTEM + [9] * 70)
    assert hit.length == 64 and hit.entry_id == long.entry_id  # newest of the equals
    c.release(hit)
    assert short.entry_id != long.entry_id


def test_max_len_leaves_tokens_to_compute():
    c = cache()
    record(c, SYSTEM + list(range(64)))
    hit = c.lookup(S, SYSTEM + list(range(64)), max_len=127)
    assert hit.length == 64


def test_whole_entry_mode_serves_only_queries_containing_the_whole_entry():
    c = cache(whole_entry=True, kind="KvRecurrent")
    record(c, SYSTEM + list(range(64)))
    assert c.lookup(S, SYSTEM + [1] * 80) is None  # shares a block, but not the snapshot
    hit = c.lookup(S, SYSTEM + list(range(64)) + [1])
    assert hit.length == 128 and hit.kind == "KvRecurrent"


def test_recording_an_existing_identity_refreshes_it():
    c = cache(max_entries=2)
    record(c, SYSTEM)
    b = record(c, [1] * 64)
    assert c.reserve(S, SYSTEM, 10) is None          # refresh, not a new entry
    r = c.reserve(S, [2] * 64, 10)                   # evicts the LRU: [1]*64, not SYSTEM
    assert r.evicted == (b.entry_id,)
    assert c.stats().counters["refreshes"] == 1


def test_pinned_entries_are_never_freed_under_a_reader():
    c = cache(max_entries=1)
    a = record(c, SYSTEM)
    hit = c.lookup(S, SYSTEM + [1])
    assert c.reserve(S, [3] * 64, 10) is None        # could only fit by evicting the pinned
    assert c.stats().counters["bypasses"] == 1
    assert c.remove(a.entry_id) == []                # doomed, not freed
    assert c.lookup(S, SYSTEM + [1]) is None         # invisible to new readers
    assert c.release(hit) == [a.entry_id]            # freed with the last pin
    assert c.stats().entries == 0


def test_entry_larger_than_the_budget_bypasses():
    c = cache(max_bytes=100)
    assert c.reserve(S, SYSTEM, 101) is None
    assert c.stats().counters["bypasses"] == 1 and c.stats().entries == 0


def test_one_off_prompts_are_never_captured():
    c = cache(admission=PrefixAdmission(admit_after=2))
    for i in range(50):
        assert c.reserve(S, [i] * 64, 10) is None
    assert c.stats().entries == 0 and c.stats().counters["not_admitted"] == 50
    assert c.reserve(S, [7] * 64, 10) is not None    # the second sighting of [7]*64


def test_probes_never_hit_count_or_record():
    c = cache()
    record(c, SYSTEM)
    assert c.lookup(S, SYSTEM + [1], probe=True) is None
    assert c.reserve(S, [5] * 64, 10, probe=True) is None
    counters = c.stats().counters
    assert counters["lookups"] == 0 and counters["probes"] == 1 and counters["records"] == 1


def test_stats_split_resident_reserved_evictable():
    c = cache()
    record(c, SYSTEM, 100)
    pending = c.reserve(S, [4] * 64, 30)
    hit = c.lookup(S, SYSTEM + [1])
    s = c.stats()
    assert (s.resident_bytes, s.reserved_bytes, s.evictable_bytes, s.pinned_entries) == (100, 30, 0, 1)
    c.release(hit)
    c.abort(pending)
    s = c.stats()
    assert (s.resident_bytes, s.reserved_bytes, s.evictable_bytes) == (100, 0, 100)


def test_two_reservations_of_one_identity_keep_one_entry():
    c = cache()
    a, b = c.reserve(S, SYSTEM, 10), c.reserve(S, SYSTEM, 10)
    assert c.commit(a) and not c.commit(b)
    assert c.stats().entries == 1
