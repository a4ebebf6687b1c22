"""Admission: one-off prefixes are never captured, repeated ones are, memory stays bounded."""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy.cache.admission import PrefixAdmission, AdmissionStats


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_stream_of_one_off_prompts_admits_nothing_and_stays_bounded():
    adm = PrefixAdmission(admit_after=2, max_tracked=1024)
    assert not any(adm.observe(key(i)) for i in range(10_000))
    s = adm.stats()
    assert s == AdmissionStats(observed=10_000, admitted=0, rejected_unseen=10_000,
                               bypassed_too_large=0, tracked=1024)


def test_prefix_is_admitted_on_its_second_sighting():
    adm = PrefixAdmission(admit_after=2)
    assert adm.observe(b"stem") is False
    assert adm.observe(b"other") is False
    assert adm.observe(b"stem") is True
    assert adm.observe(b"stem") is True  # stays admitted
    assert adm.stats().admitted == 2 and adm.stats().rejected_unseen == 2


def test_admit_after_one_admits_on_first_sight():
    adm = PrefixAdmission(admit_after=1)
    assert adm.observe(b"a") is True
    assert adm.stats().rejected_unseen == 0


def test_admit_after_three():
    adm = PrefixAdmission(admit_after=3)
    assert [adm.observe(b"k") for _ in range(4)] == [False, False, True, True]


def test_least_recently_seen_key_is_forgotten_first():
    adm = PrefixAdmission(admit_after=2, max_tracked=2)
    adm.observe(b"a")
    adm.observe(b"b")
    adm.observe(b"a")          # refreshes a (and admits it)
    adm.observe(b"c")          # evicts b, the least recently seen
    assert adm.observe(b"a") is True
    assert adm.observe(b"b") is False  # b starts over


def test_forget_makes_a_key_earn_admission_again():
    adm = PrefixAdmission(admit_after=2)
    adm.observe(b"k")
    adm.observe(b"k")
    adm.forget(b"k")
    adm.forget(b"never seen")  # ignored
    assert adm.observe(b"k") is False
    assert adm.observe(b"k") is True


def test_entry_larger_than_the_budget_bypasses():
    adm = PrefixAdmission()
    assert adm.admits_size(100, 100)
    assert adm.admits_size(0, 100)
    assert not adm.admits_size(101, 100)
    assert not adm.admits_size(1, 0)  # budget 0 = disabled
    assert adm.stats().bypassed_too_large == 2


@pytest.mark.parametrize("kwargs", [{"admit_after": 0}, {"max_tracked": 0}])
def test_invalid_parameters(kwargs):
    with pytest.raises(ValueError):
        PrefixAdmission(**kwargs)


def test_negative_sizes_are_a_bug():
    with pytest.raises(ValueError):
        PrefixAdmission().admits_size(-1, 10)


def test_stats_are_a_frozen_value():
    with pytest.raises(AttributeError):
        PrefixAdmission().stats().admitted = 1  # type: ignore[misc]


def test_concurrent_sightings_are_all_counted():
    adm = PrefixAdmission(admit_after=2)
    keys = [key(i) for i in range(200)]

    def run():
        for k in keys:
            adm.observe(k)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = adm.stats()
    # Each key is rejected exactly once (its first sighting) and admitted three times.
    assert (s.observed, s.rejected_unseen, s.admitted) == (800, 200, 600)


ops = st.lists(st.tuples(st.sampled_from(["observe", "forget"]), st.integers(0, 15)),
               max_size=200)


@given(ops=ops, admit_after=st.integers(1, 4))
@settings(max_examples=200, deadline=None)
def test_matches_a_plain_counter_within_the_tracked_cap(ops, admit_after):
    adm = PrefixAdmission(admit_after=admit_after, max_tracked=16)  # >= the 16 possible keys
    seen: Counter[int] = Counter()
    for op, i in ops:
        if op == "forget":
            adm.forget(key(i))
            seen.pop(i, None)
        else:
            seen[i] += 1
            assert adm.observe(key(i)) == (seen[i] >= admit_after)
    s = adm.stats()
    assert s.observed == s.admitted + s.rejected_unseen
    assert s.tracked == len(seen)


@given(ops=st.lists(st.integers(0, 15), max_size=300), admit_after=st.integers(1, 4),
       cap=st.integers(1, 8))
@settings(max_examples=200, deadline=None)
def test_matches_a_brute_force_lru_beyond_the_cap(ops, admit_after, cap):
    adm = PrefixAdmission(admit_after=admit_after, max_tracked=cap)
    lru: OrderedDict[int, int] = OrderedDict()
    for i in ops:
        count = lru.pop(i, 0) + 1
        lru[i] = count
        while len(lru) > cap:
            lru.popitem(last=False)
        assert adm.observe(key(i)) == (count >= admit_after)
        assert adm.stats().tracked == len(lru) <= cap
