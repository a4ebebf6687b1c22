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
