"""The router: a request goes where its prefix was served, else to the least loaded."""

from __future__ import annotations

import pytest

from skippy.mesh.control.router import MAX_IMBALANCE, Router

STEM = list(range(100, 300))


def test_least_loaded_without_a_cached_prefix():
    r = Router(3, stride=64)
    assert [r.choose([i] * 10) for i in range(3)] == [0, 1, 2]
    r.finished(1)
    assert r.choose([7] * 10) == 1


def test_longest_cached_prefix_wins():
    r = Router(2, stride=64)
    a = r.choose(STEM[:130] + [1])          # a has served 64 and 128 tokens of STEM
    r.load[a] += MAX_IMBALANCE + 1          # so busy that the next one goes elsewhere
    b = r.choose(STEM[:70] + [2])           # b has served 64 of them
    assert a != b
    r.load[a] -= MAX_IMBALANCE + 1
    r.finished(a), r.finished(b)
    assert r.choose(STEM[:150] + [3]) == a  # 128 shared with a, only 64 with b
    assert r.choose(STEM[:64] + [4]) == b   # 64 with both: the less loaded


def test_namespaces_do_not_attract_each_other():
    r = Router(2, stride=64)
    a = r.choose(STEM, "tenant-a")
    r.finished(a)
    r.choose([9] * 5)                       # loads the other pipeline
    other = 1 - a
    r.finished(other)
    r.load[a] += 1                          # a busier, b idle: only a real hit draws to a
    assert r.choose(STEM, "tenant-b") == other


def test_a_busy_pipeline_gives_way():
    r = Router(2, stride=64)
    a = r.choose(STEM)
    r.load[a] += MAX_IMBALANCE + 1
    assert r.choose(STEM) == 1 - a


def test_a_request_moved_away_learns_where_its_prefix_is():
    r = Router(3, stride=64)
    a = r.route(STEM).pipeline
    assert r.route(STEM[:64] + [5]).holder is None    # kept where its prefix is
    r.finished(a), r.finished(a)
    r.load[a] += MAX_IMBALANCE + 1
    moved = r.route(STEM + [6])
    assert moved.pipeline != a and moved.holder == a  # its stages pull from a's
    r.finished(moved.pipeline)
    r.load[a] -= MAX_IMBALANCE + 1
    assert r.holder(STEM, exclude=moved.pipeline) == a  # a rebuild on the moved one
    assert r.holder([1, 2, 3] * 40) is None
    third = 3 - a - moved.pipeline                    # the only one without the prefix
    down = r.route(STEM + [7], usable=[third])        # the others cannot serve now
    assert down.pipeline == third and down.holder in (a, moved.pipeline)


def test_needs_a_pipeline():
    with pytest.raises(ValueError):
        Router(0, stride=64)
