"""Activation-frame and exact-result caches."""

from skippy.cache.activation import ActivationCache, activation_key
from skippy.cache.results import ExactResults, exact_prompt_key


def test_activation_frames_by_page_and_width_under_caps():
    c = ActivationCache(max_entries=2, max_bytes=100)
    assert activation_key("abcd", 576) == "act:abcd:w576"
    assert c.put_frame("p1", 576, "frame-1", 40)
    assert c.put_frame("p2", 576, "frame-2", 40)
    assert c.get_frame("p1", 576) == "frame-1"      # p1 now most recent
    assert c.get_frame("p1", 640) is None            # another width is another frame
    assert c.put_frame("p3", 576, "frame-3", 40)     # evicts p2 (LRU)
    assert c.get_frame("p2", 576) is None
    assert not c.put_frame("p4", 576, "huge", 101)   # larger than the cache: bypass
    s = c.stats()
    assert s.entries == 2 and s.resident_bytes == 80
    assert s.counters["evictions"] == 1 and s.counters["bypasses"] == 1


def test_exact_results_serve_only_the_identical_prompt():
    r = ExactResults(max_entries=4, max_bytes=1000)
    r.put_result(b"s", [1, 2, 3], "logits", 10)
    assert r.get_result(b"s", [1, 2, 3]) == "logits"
    assert r.get_result(b"s", [1, 2, 3, 4]) is None  # never the prefix of a longer prompt
    assert r.get_result(b"s", [1, 2]) is None
    assert r.get_result(b"other", [1, 2, 3]) is None
    assert r.get_result(b"s", [1, 2, 3], probe=True) is None
    assert exact_prompt_key(b"s", [1, 2, 3]) != exact_prompt_key(b"s", [1, 2])


def test_merged_snapshot_reports_hits_by_kind_and_bytes_by_state():
    from skippy.cache.config import CacheConfig
    from skippy.cache.prefix_cache import PrefixCache
    from skippy.cache.telemetry import merge

    kv = PrefixCache.from_config(CacheConfig(admit_after=1, max_bytes=10**6))
    r = kv.reserve(b"s", list(range(64)), 500)
    kv.commit(r)
    kv.release(kv.lookup(b"s", list(range(70))))
    act = ActivationCache(4, 1000)
    act.put_frame("p", 8, "f", 100)
    act.get_frame("p", 8)
    act.get_frame("q", 8)
    snap = merge([kv.stats(), act.stats()])
    assert snap["hits_by_kind"] == {"ResidentKv": 1, "activation": 1}
    assert snap["resident_bytes"] == 600 and snap["evictable_bytes"] == 600
    assert snap["counters"]["misses"] == 1 and snap["counters"]["lookups"] == 3
