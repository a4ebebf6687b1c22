"""Gateway exact results: only deterministic streams, the longest known run, bounded."""

from __future__ import annotations

from skippy.mesh.control.engine import GenerationRequest
from skippy.mesh.front.result_memo import KnownRun, ResultMemo, memo_key
from skippy.mesh.sampler import SamplingParams


def req(**kw) -> GenerationRequest:
    return GenerationRequest(**{"tokens": (1, 2, 3), "max_tokens": 4, **kw})


def test_only_deterministic_non_probe_requests_have_a_key():
    assert memo_key(req(), "d") is not None
    assert memo_key(req(sampling=SamplingParams(0.8, seed=3)), "d") is not None
    assert memo_key(req(sampling=SamplingParams(0.8)), "d") is None
    assert memo_key(req(probe=True), "d") is None


def test_key_separates_namespace_topology_sampling_stop_ids_and_prompt():
    base = memo_key(req(), "d")
    assert memo_key(req(max_tokens=9), "d") == base  # a stream does not depend on its limit
    for other in (memo_key(req(namespace="t"), "d"), memo_key(req(), "e"),
                  memo_key(req(sampling=SamplingParams(0, top_k=3)), "d"),
                  memo_key(req(stop_ids=frozenset({2})), "d"),
                  memo_key(req(tokens=(1, 2)), "d")):
        assert other != base


def test_longer_or_complete_runs_replace_shorter_ones():
    memo, key = ResultMemo(), memo_key(req(), "d")
    memo.record(key, KnownRun((5, 6), False), None)
    short = memo.get(key)
    memo.record(key, KnownRun((5,), False), short)           # knows less: kept as is
    assert memo.get(key) == KnownRun((5, 6), False)
    memo.record(key, KnownRun((5, 6, 7), False), memo.get(key))
    memo.record(key, KnownRun((5, 6), True), memo.get(key))  # the end is news
    assert memo.get(key) == KnownRun((5, 6), True)
    memo.record(key, KnownRun((5, 6, 7, 8), False), memo.get(key))
    assert memo.get(key) == KnownRun((5, 6), True)


def test_entries_are_bounded_lru():
    memo = ResultMemo(max_entries=2)
    keys = [memo_key(req(tokens=(i,)), "d") for i in range(3)]
    for k in keys:
        memo.record(k, KnownRun((1,), False), None)
    assert len(memo) == 2 and memo.get(keys[0]) is None and memo.get(keys[2]) is not None
    assert memo.stats().counters["evictions"] == 1
