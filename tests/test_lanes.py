"""Request lanes: a follow-up gets the warm lane that holds most of its prompt, warm
lanes are capped and given up oldest first when the runtime runs out."""

from __future__ import annotations

import pytest

from skippy.stages.lanes import Lanes
from skippy.stages.runtime import StageError


class FewLanes:
    """A runtime with a fixed number of lanes (only what Lanes calls)."""

    def __init__(self, n: int):
        self.idle = list(range(n))

    def alloc_lane(self) -> int:
        if not self.idle:
            raise StageError("no lane free")
        return self.idle.pop(0)

    def free_lane(self, lane: int) -> None:
        self.idle.append(lane)


def shared(held: list[int], tokens: list[int]) -> int:
    n = 0
    while n < min(len(held), len(tokens)) and held[n] == tokens[n]:
        n += 1
    return n


def test_a_follow_up_gets_the_warm_lane_holding_most_of_its_prompt():
    lanes = Lanes(FewLanes(4), max_warm=None)
    a, b = lanes.alloc(lambda _: 0), lanes.alloc(lambda _: 0)
    lanes.hold(a, [1, 2], "")
    lanes.hold(b, [1, 2, 3, 4], "")
    for lane in (a, b):
        lanes.release(lane, keep_warm=True)
    assert lanes.alloc(lambda lane: shared(lanes.info(lane).tokens, [1, 2, 3, 9])) == b
    assert lanes.warm == 1


def test_out_of_lanes_the_oldest_warm_lane_is_given_up():
    rt = FewLanes(2)
    lanes = Lanes(rt, max_warm=None)
    a, b = lanes.alloc(lambda _: 0), lanes.alloc(lambda _: 0)
    for lane in (a, b):
        lanes.hold(lane, [lane + 1], "")
        lanes.release(lane, keep_warm=True)
    assert lanes.alloc(lambda _: 0) == a and lanes.warm == 1
    assert lanes.alloc(lambda _: 0) == b and lanes.warm == 0
    with pytest.raises(StageError):
        lanes.alloc(lambda _: 0)


def test_warm_lanes_are_capped_and_empty_lanes_never_kept():
    rt = FewLanes(8)
    lanes = Lanes(rt, max_warm=2)
    held = [lanes.alloc(lambda _: 0) for _ in range(3)]
    empty = lanes.alloc(lambda _: 0)
    for lane in held:
        lanes.hold(lane, [7], "")
        lanes.release(lane, keep_warm=True)
    lanes.release(empty, keep_warm=True)
    assert lanes.warm == 2 and held[0] in rt.idle and empty in rt.idle
    lanes.drop_warm()
    assert lanes.warm == 0 and len(rt.idle) == 8


def test_a_lanes_cache_addresses_follow_its_buffers():
    """decoder.c reads K and V at the addresses LaneKv.pointers gives: the same tuple
    between steps, new ones once the buffers grow or are replaced."""
    from skippy.stages.kv import LaneKv
    kv = LaneKv(2, 1, 4, 4, step=8, max_tokens=64)
    kv.ensure(8)
    first = kv.pointers()
    assert kv.pointers() is first
    assert first == (tuple(t.data_ptr() for t in kv.k), tuple(t.data_ptr() for t in kv.v))
    kv.ensure(8)  # no growth: the same buffers
    assert kv.pointers() is first
    kv.ensure(9)
    grown = kv.pointers()
    assert grown != first and grown[0][1] == kv.k[1].data_ptr()
    kv.k = [t.clone() for t in kv.k]
    assert kv.pointers()[0] == tuple(t.data_ptr() for t in kv.k)
